"""llmtrace reads GGUF metadata and the tensor directory itself (the gguf package's reader takes seconds on a
50,000-token vocabulary); it must see exactly what the gguf package's GGUFReader sees."""

import numpy as np
import pytest
from gguf import GGUFReader

from llmtrace.checkpoint.gguf_file import open_gguf
from tiny import TinySpec, make_hf_model, write_gguf


def _reference_value(field):
    return field.contents()


def assert_same_as_gguf_package(path):
    ours = open_gguf(path)
    ref = GGUFReader(str(path), "r")
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.fields) == set(ref_fields)
    for key, field in ref_fields.items():
        assert ours.fields[key].contents() == _reference_value(field), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type, a.name
        assert tuple(a.shape) == tuple(int(x) for x in b.shape), a.name
        assert a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name


def test_tiny_gguf_reads_like_the_gguf_package(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, make_hf_model(TinySpec(seed=31)))
    assert_same_as_gguf_package(path)


@pytest.mark.slow
def test_real_gguf_reads_like_the_gguf_package(smollm_path):
    assert_same_as_gguf_package(smollm_path)
