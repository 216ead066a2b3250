"""Share offers in the registry over gRPC on real Redis and S3: an offer (ShareRequest.offer) takes any tenant name
alike, resolves for no one until its recipient accepts it (AnswerShareOffer), and goes with its adapter; an
operator's direct share (offer unset) still shares at once with existing tenants only."""

from __future__ import annotations

import pytest

from preft.api.v1 import registry_pb2 as pb
from preft.common.errors import FailedPrecondition, NotFound
from preft.registry.client import RegistryClient, scan_adapter_dir
from preft.registry.service import MAX_PENDING_OFFERS


@pytest.fixture
def acme(client, base_config, tiny) -> RegistryClient:
    client.call("RegisterBaseModel", pb.RegisterBaseModelRequest(id="tiny-llama", config_json=base_config))
    for t in ("acme", "beta"):
        client.call("CreateTenant", pb.CreateTenantRequest(id=t))
    client.upload_adapter(scan_adapter_dir(tiny["lora"]), tenant="acme", name="secret")
    return client


def _offer(c: RegistryClient, *add: str, remove: tuple[str, ...] = ()) -> pb.Adapter:
    return c.call("Share", pb.ShareRequest(tenant="acme", name="secret", add=add, remove=remove, offer=True))


def _offers(c: RegistryClient, tenant: str) -> list[tuple[str, str, bool]]:
    listed = c.call("ListShareOffers", pb.ListShareOffersRequest(tenant=tenant)).offers
    return [(o.adapter.tenant, o.adapter.name, o.accepted) for o in listed]


def _answer(c: RegistryClient, tenant: str, accept: bool, owner: str = "acme") -> pb.ShareOffer:
    return c.call(
        "AnswerShareOffer", pb.AnswerShareOfferRequest(tenant=tenant, owner=owner, name="secret", accept=accept)
    )


def test_an_offer_resolves_only_once_accepted(acme):
    offered = _offer(acme, "beta", "ghost")  # (ghost is no tenant: the offer is taken all the same)
    assert (list(offered.offered_to), list(offered.shared_with)) == (["beta", "ghost"], [])
    with pytest.raises(NotFound):
        acme.resolve("beta", "acme/secret")
    assert acme.call("ListAdapters", pb.ListAdaptersRequest(tenant="beta")).adapters == []
    assert _offers(acme, "beta") == [("acme", "secret", False)]

    accepted = _answer(acme, "beta", True)
    assert accepted.accepted and accepted.adapter.latest.version == 1
    assert acme.resolve("beta", "acme/secret").version == 1
    assert _offers(acme, "beta") == [("acme", "secret", True)]
    shown = acme.call("GetAdapter", pb.GetAdapterRequest(tenant="acme", name="secret"))
    assert (list(shown.offered_to), list(shown.shared_with)) == (["ghost"], ["beta"])
    assert list(_offer(acme, "beta").shared_with) == ["beta"]  # (offering an accepted share keeps it)

    assert not _answer(acme, "beta", False).accepted  # the recipient leaves the share
    with pytest.raises(NotFound):
        acme.resolve("beta", "acme/secret")
    for owner in ("acme", "nobody"):  # nothing (left) to answer: one NotFound, whoever the owner
        with pytest.raises(NotFound, match="no share offer of"):
            _answer(acme, "beta", True, owner=owner)

    _offer(acme, "beta")
    acme.call("Delete", pb.DeleteRequest(tenant="acme", name="secret"))
    assert _offers(acme, "beta") == []


def test_pending_offers_are_bounded_and_direct_shares_are_for_existing_tenants(acme):
    many = [f"t{i}" for i in range(MAX_PENDING_OFFERS)]
    assert len(_offer(acme, *many).offered_to) == MAX_PENDING_OFFERS
    with pytest.raises(FailedPrecondition, match="pending"):
        _offer(acme, "one-more")
    assert list(_offer(acme, remove=tuple(many)).offered_to) == []

    with pytest.raises(NotFound, match="ghost"):
        acme.call("Share", pb.ShareRequest(tenant="acme", name="secret", add=["ghost"]))
    _offer(acme, "beta")
    direct = acme.call("Share", pb.ShareRequest(tenant="acme", name="secret", add=["beta"]))
    assert (list(direct.offered_to), list(direct.shared_with)) == ([], ["beta"])  # (the offer became the share)
    assert acme.resolve("beta", "acme/secret").version == 1
