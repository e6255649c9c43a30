"""The model store: references, sources, content-addressed blobs, discovery, GGUF inspection.

Other modules use `resolve(ref) -> ResolvedModel` (a local GGUF path, downloaded when needed)
and `inspect(path) -> ModelInfo`. See docs/models.md for the reference forms and the layout.
"""

from __future__ import annotations

from apirctl.models.aliases import DEMO
from apirctl.models.catalog import ListedModel, ModelFile, ResolvedModel, list_models, pull, remove, resolve
from apirctl.models.download import DownloadProgress
from apirctl.models.ggufinfo import Header, ModelInfo, header, inspect

__all__ = ["DEMO", "DownloadProgress", "Header", "ListedModel", "ModelFile", "ModelInfo", "ResolvedModel", "header",
           "inspect", "list_models", "pull", "remove", "resolve"]
