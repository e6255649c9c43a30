"""The model store: references, sources, content-addressed blobs, discovery, GGUF inspection.

Other modules use `resolve(ref) -> ResolvedModel` (a local GGUF path, downloaded when needed)
and `inspect(path) -> ModelInfo`. See docs/models.md for the reference forms and the layout.
"""

from __future__ import annotations

from apirctl.models.aliases import DEMO
from apirctl.models.catalog import ListedModel, ResolvedModel, list_models, pull, remove, resolve
from apirctl.models.ggufinfo import ModelInfo, inspect

__all__ = ["DEMO", "ListedModel", "ModelInfo", "ResolvedModel", "inspect", "list_models", "pull", "remove",
           "resolve"]
