"""Weight buckets between processes: through the object store (arrays) or, on one machine,
shared-memory files that the reader deletes."""

import torch

from slime_rl.core.weights.transport import (
    from_host_arrays,
    read_bucket_file,
    shared_memory_dir,
    to_host_arrays,
    write_bucket_file,
)


def bucket() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(7, 5, generator=gen).to(torch.bfloat16)),
            ("model.norm.weight", torch.randn(5, generator=gen)),
            ("lm_head.weight", torch.randn(5, 7, generator=gen).t().to(torch.bfloat16))]  # not contiguous


def assert_same(got, want):
    assert [n for n, _ in got] == [n for n, _ in want]  # the order a trainer sent
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_bucket_file_is_exact_and_gone_once_read(tmp_path):
    path = write_bucket_file(bucket(), tmp_path)
    assert_same(read_bucket_file(path), bucket())
    assert list(tmp_path.iterdir()) == []  # the pages are freed with the file


def test_host_arrays_are_exact():
    assert_same(from_host_arrays(to_host_arrays(bucket())), bucket())


def test_shared_memory_dir_is_writable():
    path = write_bucket_file(bucket()[:1], shared_memory_dir())
    assert_same(read_bucket_file(path), bucket()[:1])
