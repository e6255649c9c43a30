"""The content-addressed store's invariants under any sequence of adds and removes."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from apirctl.models.store import Store, StoredRef, now

NAMES = [f"hf://org/repo/m{i}.gguf" for i in range(4)]
CONTENTS = [b"GGUF" + bytes([i]) * 64 for i in range(3)]

ops = st.lists(st.tuples(st.sampled_from(["add", "rm"]), st.sampled_from(NAMES), st.sampled_from(CONTENTS)),
               max_size=25)


def add(store: Store, name: str, data: bytes) -> None:
    digest = hashlib.sha256(data).hexdigest()
    store.partial.mkdir(parents=True, exist_ok=True)
    tmp = store.partial_path(name)
    tmp.write_bytes(data)
    store.adopt(tmp, digest)
    store.put(StoredRef(name=name, source="hf", digest=f"sha256:{digest}", size=len(data), filename="m.gguf",
                        pulled_at=now()))


@settings(max_examples=60, deadline=None)
@given(ops)
def test_blobs_live_exactly_as_long_as_a_name_uses_them(sequence: list[tuple[str, str, bytes]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "models")
        model: dict[str, bytes] = {}
        for op, name, data in sequence:
            if op == "add":
                add(store, name, data)
                model[name] = data
            else:
                removed = store.remove(name)
                assert (removed is not None) == (name in model)
                if removed is not None:
                    del model[name]
                    still_used = any(hashlib.sha256(d).hexdigest() == removed[0].hexdigest for d in model.values())
                    assert removed[1] == (not still_used)
        assert {r.name for r in store.refs()} == set(model)
        for name, data in model.items():
            ref = store.get(name)
            assert ref is not None and store.blob_path(ref.hexdigest).read_bytes() == data
        blobs = sorted(p.name for p in store.blobs.glob("*")) if store.blobs.exists() else []
        expected = sorted({f"sha256-{hashlib.sha256(d).hexdigest()}.gguf" for d in model.values()})
        assert blobs == expected  # one copy per content, none orphaned
        assert list(store.partial.glob("*")) == []  # adopted files leave nothing behind
