"""The chart's values are documented (a `# --` comment on every key), the README table is generated from them and
current, and values.yaml and values.schema.json agree."""

from __future__ import annotations

import importlib.util
import json
import sys

import jsonschema
import pytest

from tests.deploy import manifests as m

_spec = importlib.util.spec_from_file_location("values_doc", m.REPO / "helm" / "tools" / "values_doc.py")
values_doc = importlib.util.module_from_spec(_spec)
sys.modules["values_doc"] = values_doc
_spec.loader.exec_module(values_doc)

VALUES_TEXT = (m.CHART / "values.yaml").read_text()
SCHEMA = json.loads((m.CHART / "values.schema.json").read_text())


def test_every_key_has_a_dash_dash_comment():
    docs = values_doc.value_docs(VALUES_TEXT)
    assert len(docs) > 80
    assert values_doc.undocumented(VALUES_TEXT) == []


def test_the_checker_finds_a_missing_comment():
    text = "# -- documented\na: 1\nb:\n  # -- documented\n  c: 2\n# a plain comment is not enough\nd: 3\n"
    assert values_doc.undocumented(text) == ["b (line 3)", "d (line 7)"]


def test_multiline_descriptions_and_flow_values():
    text = "# -- first line\n# second line\nres: {requests: {cpu: 1}}\n"
    (doc,) = values_doc.value_docs(text)
    assert doc.description == "first line second line"
    assert doc.default == {"requests": {"cpu": 1}}


def test_readme_table_is_current():
    readme = (m.CHART / "README.md").read_text()
    assert values_doc.render_readme(readme, VALUES_TEXT) == readme, "run: python helm/tools/values_doc.py helm/preft"


@pytest.mark.parametrize("name", ["values.yaml", "values-cpu.yaml", "values-gpu.yaml"])
def test_value_files_satisfy_the_schema(name):
    """What Helm validates: the defaults coalesced with the file (jsonschema here, Helm's own validator too)."""
    import helm_python

    with helm_python.Chart.load(m.CHART) as chart:
        merged = chart.merge_values(m.helm_values_file(name))
        chart.validate_schema(m.helm_values_file(name))
    jsonschema.Draft7Validator(SCHEMA).validate(merged)


def test_schema_and_values_have_the_same_keys():
    """Every values key is in the schema and every schema property is a values key (objects that are free-form maps
    in both, such as resources or env, are leaves)."""

    docs = values_doc.value_docs(VALUES_TEXT)
    sections = {d.path for d in docs if d.section}

    def schema_paths(s, prefix=""):
        out = set()
        for k, sub in (s.get("properties") or {}).items():
            path = f"{prefix}.{k}" if prefix else k
            out.add(path)
            if path in sections:
                out |= schema_paths(sub, path)
        return out

    value_paths = {d.path for d in docs}
    schema = schema_paths(SCHEMA) - {"global"}
    assert value_paths - schema == set(), "values keys missing from the schema"
    assert schema - value_paths == set(), "schema properties missing from values.yaml"


def test_schema_is_closed_where_it_should_be():
    def closed(s, path="(root)"):
        if s.get("type") == "object" and "properties" in s:
            assert s.get("additionalProperties") is False, f"{path} accepts unknown keys"
            for k, sub in s["properties"].items():
                closed(sub, f"{path}.{k}")

    closed(SCHEMA)
