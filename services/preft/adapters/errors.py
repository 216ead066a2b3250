"""The error every adapter problem becomes: it names the file and, where there is one, the tensor."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter directory that cannot be served with the given base model."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None) -> None:
        self.file = file
        self.tensor = tensor
        where = ": ".join(part for part in (file, f"tensor '{tensor}'" if tensor else None) if part)
        super().__init__(f"{where}: {message}" if where else message)
