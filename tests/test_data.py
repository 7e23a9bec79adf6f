"""Shard file format (llm.c layout) and the resumable ShardLoader."""

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from gptlite.data.loader import ShardLoader, check_vocab, find_shards, read_shard, write_shard

HEADER_BYTES = 1024


def parse_raw(path: Path) -> tuple[tuple[int, ...], bytes]:
    """Split a shard into its 256 little-endian int32 header values and the token bytes, independently of read_shard."""
    raw = Path(path).read_bytes()
    header = struct.unpack("<256i", raw[:HEADER_BYTES])
    return header, raw[HEADER_BYTES:]


def header_bytes(magic: int, version: int, count: int) -> bytes:
    return struct.pack("<256i", magic, version, count, *([0] * 253))


# ---------------------------------------------------------------------------------------------
# the file format


@pytest.mark.parametrize(
    "vocab_size, magic, version, dtype",
    [(256, 20240520, 1, "<u2"), (65536, 20240520, 1, "<u2"), (65537, 20240801, 7, "<u4"), (100277, 20240801, 7, "<u4")],
)
def test_shard_round_trip_and_llmc_header(tmp_path, vocab_size, magic, version, dtype):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab_size, size=1000)
    tokens[:2] = (0, vocab_size - 1)  # both ends of the range
    path = tmp_path / "train_000000.bin"
    write_shard(path, tokens, vocab_size)

    header, body = parse_raw(path)
    assert header[0] == magic
    assert header[1] == version
    assert header[2] == len(tokens)
    assert all(h == 0 for h in header[3:])
    itemsize = np.dtype(dtype).itemsize
    assert len(body) == len(tokens) * itemsize
    assert path.stat().st_size == HEADER_BYTES + len(tokens) * itemsize
    np.testing.assert_array_equal(np.frombuffer(body, dtype=dtype), tokens)
    # the header's first bytes, spelled out: little-endian int32 magic, version, count
    first_ints = magic.to_bytes(4, "little") + version.to_bytes(4, "little") + (1000).to_bytes(4, "little")
    assert path.read_bytes()[:12] == first_ints

    read = read_shard(path)
    assert isinstance(read, np.memmap)
    assert read.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(read, tokens)
    assert not list(tmp_path.glob("*.tmp"))  # the atomic write left no temp file


def test_read_shard_of_a_hand_written_llmc_file(tmp_path):
    """A file built byte by byte to llm.c's layout reads back, without write_shard involved."""
    tokens = [50256, 15496, 995, 0, 65535]
    path = tmp_path / "llmc.bin"
    path.write_bytes(header_bytes(20240520, 1, len(tokens)) + struct.pack(f"<{len(tokens)}H", *tokens))
    assert read_shard(path).tolist() == tokens
    big = [0, 100276, 2**32 - 1]
    path.write_bytes(header_bytes(20240801, 7, len(big)) + struct.pack(f"<{len(big)}I", *big))
    assert read_shard(path).tolist() == big


def test_empty_shard_round_trips(tmp_path):
    path = tmp_path / "empty.bin"
    write_shard(path, [], 256)
    header, body = parse_raw(path)
    assert header[:3] == (20240520, 1, 0) and body == b""
    assert len(read_shard(path)) == 0


def test_bad_magic(tmp_path):
    path = tmp_path / "bad.bin"
    path.write_bytes(header_bytes(12345, 1, 2) + b"\0" * 4)
    with pytest.raises(ValueError, match=r"bad\.bin has bad magic 12345; expected 20240520 or 20240801"):
        read_shard(path)


@pytest.mark.parametrize("magic, version", [(20240520, 7), (20240801, 1), (20240520, 2)])
def test_unknown_version(tmp_path, magic, version):
    path = tmp_path / "v.bin"
    path.write_bytes(header_bytes(magic, version, 0))
    with pytest.raises(ValueError, match=rf"unknown version {version} for magic {magic}"):
        read_shard(path)


def test_truncated_tokens(tmp_path):
    path = tmp_path / "short.bin"
    write_shard(path, list(range(100)), 256)
    path.write_bytes(path.read_bytes()[:-10])  # lose the last 5 uint16 tokens
    message = r"truncated: header says 100 tokens \(1224 bytes\) but the file has 1214 bytes"
    with pytest.raises(ValueError, match=message):
        read_shard(path)


def test_negative_count_is_rejected(tmp_path):
    path = tmp_path / "neg.bin"
    path.write_bytes(header_bytes(20240520, 1, -1))
    with pytest.raises(ValueError, match="truncated: header says -1 tokens"):
        read_shard(path)


@pytest.mark.parametrize("size", [0, 12, 1023])
def test_too_short_for_a_header(tmp_path, size):
    path = tmp_path / "tiny.bin"
    path.write_bytes(header_bytes(20240520, 1, 0)[:size])
    with pytest.raises(ValueError, match=rf"truncated: {size} bytes is smaller than the 1024-byte header; prepare the"):
        read_shard(path)


def test_extra_trailing_bytes(tmp_path):
    path = tmp_path / "long.bin"
    write_shard(path, [1, 2, 3], 256)
    with open(path, "ab") as f:
        f.write(b"\x07\x00\x08")
    with pytest.raises(ValueError, match=r"has 3 bytes beyond the 3 tokens its header declares"):
        read_shard(path)


def test_missing_shard(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"shard .*nope\.bin does not exist"):
        read_shard(tmp_path / "nope.bin")


@pytest.mark.parametrize("tokens, vocab_size", [([0, 256], 256), ([-1, 3], 256), ([70000], 70000), ([5, 2**17], 2**17)])
def test_write_shard_rejects_out_of_range_ids(tmp_path, tokens, vocab_size):
    path = tmp_path / "x.bin"
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {vocab_size}\)"):
        write_shard(path, tokens, vocab_size)
    assert not path.exists()


def test_check_vocab(tmp_path):
    ok, bad = tmp_path / "a_train.bin", tmp_path / "b_train.bin"
    write_shard(ok, [0, 1, 99], 256)
    write_shard(bad, [0, 200, 150], 256)
    check_vocab([ok], 100)  # every id < 100: passes
    check_vocab([ok, bad], 201)
    with pytest.raises(ValueError, match=r"shard .*b_train\.bin holds token id 200 but the model's vocab_size is 100"):
        check_vocab([ok, bad], 100)
    with pytest.raises(ValueError, match="at least 201"):
        check_vocab([bad], 200)
    # scanning in small chunks finds an id in the last chunk too
    with pytest.raises(ValueError, match="holds token id 200"):
        check_vocab([bad], 150, chunk=1)


def test_check_vocab_uint32(tmp_path):
    path = tmp_path / "big.bin"
    write_shard(path, [3, 70000, 1], 100000)
    check_vocab([path], 70001)
    with pytest.raises(ValueError, match=r"big\.bin holds token id 70000 but the model's vocab_size is 70000"):
        check_vocab([path], 70000)


def test_find_shards(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    for name in ["val_000000.bin", "train_000001.bin", "train_000000.bin", "notes.txt", "other.bin"]:
        (d / name).write_bytes(b"")
    (d / "train_extra.txt").write_bytes(b"")
    assert find_shards(d, "train") == [d / "train_000000.bin", d / "train_000001.bin"]
    assert find_shards(str(d), "val") == [d / "val_000000.bin"]
    # a glob is taken as given
    assert find_shards(str(d / "*_00000[01].bin"), "train") == [
        d / "train_000000.bin",
        d / "train_000001.bin",
        d / "val_000000.bin",
    ]
    assert find_shards(str(d / "train_*.bin"), "train") == [d / "train_000000.bin", d / "train_000001.bin"]
    # a single file
    assert find_shards(str(d / "val_000000.bin"), "val") == [d / "val_000000.bin"]
    with pytest.raises(FileNotFoundError, match=r"no test shards found at .*data; expected \*test\*\.bin files"):
        find_shards(d, "test")
    with pytest.raises(FileNotFoundError, match=r"no train shards found at .*missing_\*\.bin"):
        find_shards(str(tmp_path / "missing_*.bin"), "train")


# ---------------------------------------------------------------------------------------------
# the loader


def make_shards(tmp_path: Path, sizes: list[int], vocab_size: int = 1000, seed: int = 0):
    """Write one shard of random tokens per size; returns the files and their token arrays."""
    rng = np.random.default_rng(seed)
    files, arrays = [], []
    for i, n in enumerate(sizes):
        tokens = rng.integers(0, vocab_size, size=n)
        path = tmp_path / f"train_{i:06d}.bin"
        write_shard(path, tokens, vocab_size)
        files.append(path)
        arrays.append(tokens)
    return files, arrays


def windows_of(batches, arrays, block_size):
    """Map each row of each x batch back to its (shard, start) by searching the raw tokens."""
    found = []
    for x, y in batches:
        for row_x, row_y in zip(x.numpy(), y.numpy(), strict=True):
            hits = [
                (s, i)
                for s, a in enumerate(arrays)
                for i in range(len(a) - block_size)
                if np.array_equal(a[i : i + block_size], row_x) and np.array_equal(a[i + 1 : i + block_size + 1], row_y)
            ]
            assert len(hits) == 1, hits
            found.append(hits[0])
    return found


def batches(loader: ShardLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_loader_shapes_dtype_and_shift(tmp_path):
    files, arrays = make_shards(tmp_path, [500])
    loader = ShardLoader(files, batch_size=4, block_size=16, seed=1)
    for x, y in batches(loader, 5):
        assert x.shape == y.shape == (4, 16)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
    # every row is a real window of the shard, with y the next token after each x token
    found = windows_of(batches(ShardLoader(files, batch_size=4, block_size=16, seed=1), 3), arrays, 16)
    for s, i in found:
        assert s == 0 and 0 <= i and i + 17 <= 500


def test_loader_unshuffled_reads_consecutive_windows(tmp_path):
    files, arrays = make_shards(tmp_path, [100])
    loader = ShardLoader(files, batch_size=2, block_size=8, shuffle=False)
    x, y = loader.next_batch()
    a = arrays[0]
    np.testing.assert_array_equal(x.numpy(), np.stack([a[0:8], a[8:16]]))
    np.testing.assert_array_equal(y.numpy(), np.stack([a[1:9], a[9:17]]))


def windows_by_epoch(files, arrays, block_size, seed, epochs):
    """Each epoch's windows, in order, read one window per batch through the public API."""
    loader = ShardLoader(files, batch_size=1, block_size=block_size, seed=seed)
    out = [[] for _ in range(epochs)]
    while True:
        batch = loader.next_batch()
        if loader.epoch >= epochs:  # the state after a batch names the epoch its window came from
            return out
        out[loader.epoch] += windows_of([batch], arrays, block_size)


def test_loader_epoch_visits_every_window_once(tmp_path):
    sizes, T = [61, 45, 33], 8
    files, arrays = make_shards(tmp_path, sizes)
    epochs = windows_by_epoch(files, arrays, T, seed=3, epochs=3)
    offsets = set()
    for windows in epochs:
        assert len(windows) == len(set(windows))  # no window twice in an epoch
        for s, n in enumerate(sizes):
            starts = sorted(i for shard, i in windows if shard == s)
            # a random offset below T, then every block-aligned window that fits
            assert 0 <= starts[0] < T and starts[-1] + T + 1 <= n and starts[-1] + 2 * T + 1 > n
            assert np.all(np.diff(starts) == T)
            offsets.add(starts[0])
        # shards are read one after the other, never interleaved
        shard_runs = [s for k, (s, _) in enumerate(windows) if k == 0 or windows[k - 1][0] != s]
        assert sorted(shard_runs) == [0, 1, 2]
    assert len({tuple(w) for w in epochs}) == 3  # every epoch is shuffled afresh
    assert len(offsets) > 1  # the windows' phase changes too, so every token pair gets trained on


def test_loader_determinism(tmp_path):
    files, _ = make_shards(tmp_path, [300, 200, 150])
    a = batches(ShardLoader(files, batch_size=3, block_size=8, seed=42), 20)
    b = batches(ShardLoader(files, batch_size=3, block_size=8, seed=42), 20)
    c = batches(ShardLoader(files, batch_size=3, block_size=8, seed=43), 20)
    assert_same(a, b)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c, strict=True))


def test_loader_shuffles_within_an_epoch(tmp_path):
    files, _ = make_shards(tmp_path, [1000])
    x, _ = ShardLoader(files, batch_size=8, block_size=8, seed=0).next_batch()
    x_plain, _ = ShardLoader(files, batch_size=8, block_size=8, shuffle=False).next_batch()
    assert not torch.equal(x, x_plain)


@pytest.mark.parametrize("steps_before", [0, 1, 4, 7, 13])
def test_state_restore_reproduces_following_batches(tmp_path, steps_before):
    # small shards: a few windows each, so the checkpoints fall in different shards and epochs
    files, _ = make_shards(tmp_path, [40, 57, 25, 33])
    kw = dict(batch_size=3, block_size=7, seed=5)
    loader = ShardLoader(files, **kw)
    batches(loader, steps_before)
    state = loader.state()
    assert set(state) == {"epoch", "shard", "index"}
    expected = batches(loader, 12)

    fresh = ShardLoader(files, **kw)
    fresh.restore(dict(state))
    assert_same(batches(fresh, 12), expected)


def test_state_restore_across_an_epoch_boundary(tmp_path):
    files, _ = make_shards(tmp_path, [40, 57, 25, 33])
    kw = dict(batch_size=2, block_size=7, seed=11)
    loader = ShardLoader(files, **kw)
    epochs_seen = set()
    for _ in range(40):
        before = loader.state()
        following = batches(loader, 3)
        epochs_seen.add(loader.epoch)
        restored = ShardLoader(files, **kw)
        restored.restore(before)
        assert_same(batches(restored, 3), following)
    assert max(epochs_seen) >= 2  # ran through several epoch boundaries


def test_state_is_plain_ints(tmp_path):
    files, _ = make_shards(tmp_path, [40, 57])
    loader = ShardLoader(files, batch_size=2, block_size=7, seed=0)
    batches(loader, 5)
    assert all(type(v) is int for v in loader.state().values())


@pytest.mark.parametrize("shuffle", [True, False])
def test_ranks_split_the_global_batch(tmp_path, shuffle):
    files, arrays = make_shards(tmp_path, [90, 70, 50])
    B, T, steps = 2, 8, 6
    kw = dict(block_size=T, seed=9, shuffle=shuffle)
    r0 = batches(ShardLoader(files, batch_size=B, rank=0, world_size=2, **kw), steps)
    r1 = batches(ShardLoader(files, batch_size=B, rank=1, world_size=2, **kw), steps)
    one = batches(ShardLoader(files, batch_size=2 * B, **kw), steps)
    for (x0, y0), (x1, y1), (x, y) in zip(r0, r1, one, strict=True):
        assert torch.equal(torch.cat([x0, x1]), x)
        assert torch.equal(torch.cat([y0, y1]), y)
    # within each step, the two ranks read different windows
    w0 = windows_of(r0, arrays, T)
    w1 = windows_of(r1, arrays, T)
    for step in range(steps):
        assert not set(w0[step * B : (step + 1) * B]) & set(w1[step * B : (step + 1) * B])
    # over the first epoch (at least 22 windows; 5 steps read 20) no window is read twice by any rank
    first = w0[: 5 * B] + w1[: 5 * B]
    assert len(set(first)) == len(first)


def test_fewer_than_one_batch(tmp_path):
    files, _ = make_shards(tmp_path, [20, 10])  # (19 // 8) + (9 // 8) = 3 windows
    ShardLoader(files, batch_size=3, block_size=8)  # exactly one batch is enough
    message = (
        r"30 tokens in 2 shard\(s\) .* make 3 windows of block_size\+1=9 tokens, fewer than one batch of 4; use more "
        r"data, --batch_size=3 or less, or a smaller --block_size$"
    )
    with pytest.raises(ValueError, match=message):
        ShardLoader(files, batch_size=4, block_size=8)
    with pytest.raises(ValueError, match="fewer than one batch of 4; use more data, --batch_size=1 or less, or a"):
        ShardLoader(files, batch_size=2, block_size=8, world_size=2)
