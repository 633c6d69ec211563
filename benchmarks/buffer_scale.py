"""How the prompt data source and the sample buffer scale.

Writes a 1,000,000-line JSONL (and the same rows as Parquet) to a temp dir, then,
each in a fresh process: open the file and read the first batch (shuffled), resume
at the middle of an epoch from a saved state, the check slime-cli runs in the driver
before Ray starts (every record parsed), and the buffer's add/take of a realistic
batch. Prints one table ("read s": the first batch, or the whole file for a check).
Targets: open + first batch under 10 s, RSS growth under 200 MB.

    .venv/bin/python benchmarks/buffer_scale.py [--lines 1000000] [--batch 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

MEASURE = textwrap.dedent("""
    import json, sys, time
    def rss_mb(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    from slime_rl.buffer import PromptDataSource, SampleBuffer
    case, path, batch, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    base = rss_mb("VmRSS:")
    t0 = time.perf_counter()
    source = PromptDataSource(path, n_samples_per_prompt=n, seed=1, num_epoch=2)
    t1, c1 = time.perf_counter(), time.process_time()
    if case == "resume":
        state = source.state_dict()
        state["position"] = len(source) // 2
        source.load_state_dict(state)
    if case == "check":
        assert source.check_records() == len(source)
    else:
        groups = source.get_groups(batch)
        assert len(groups) == batch and len(groups[0]) == n
    t2, c2 = time.perf_counter(), time.process_time()
    print(json.dumps({"open_s": t1 - t0, "batch_s": t2 - t1, "batch_cpu_s": c2 - c1, "rss_mb": rss_mb("VmRSS:") - base,
                      "peak_mb": rss_mb("VmHWM:") - base}))
""")

BUFFER = textwrap.dedent("""
    import json, sys, time, random
    from slime_rl.buffer import SampleBuffer
    from slime_rl.core.sample import Sample, SampleStatus
    directory, groups_n, n, resp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(0)
    groups = []
    for g in range(groups_n):
        group = []
        for k in range(n):
            s = Sample(index=g * n + k, group_index=g, prompt="p" * 200, label="42",
                       tokens=[rng.randrange(150_000) for _ in range(256)])
            s.append_response([rng.randrange(150_000) for _ in range(resp)], [-rng.random() for _ in range(resp)],
                              trained=True)
            s.status, s.reward = SampleStatus.COMPLETED, 1.0
            group.append(s)
        groups.append(group)
    buffer = SampleBuffer(directory)
    t0 = time.perf_counter(); buffer.add(groups); t1 = time.perf_counter()
    size = buffer.store.file_bytes()
    taken = buffer.take(groups_n); t2 = time.perf_counter()
    assert sum(map(len, taken)) == groups_n * n
    print(json.dumps({"add_s": t1 - t0, "take_s": t2 - t1, "file_mb": size / 2**20}))
""")


def write_prompts(directory: Path, lines: int) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl, parquet = directory / "prompts.jsonl", directory / "prompts.parquet"
    chunk = 100_000
    with open(jsonl, "w") as f, pq.ParquetWriter(parquet, pa.schema([
            ("input", pa.string()), ("label", pa.string()), ("metadata", pa.struct([("id", pa.int64())]))])) as pw:
        for start in range(0, lines, chunk):
            rows = [{"input": f"Question {i}: what is {i % 977} + {i % 131}? Think step by step and put the "
                              f"answer in \\boxed{{}}.", "label": str(i % 977 + i % 131), "metadata": {"id": i}}
                    for i in range(start, min(lines, start + chunk))]
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            pw.write_table(pa.Table.from_pylist(rows, schema=pw.schema), row_group_size=64_000)
    return jsonl, parquet


def run(script: str, *args: object) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=256, help="prompts per batch (data.rollout_batch_size)")
    parser.add_argument("--n", type=int, default=8, help="data.n_samples_per_prompt")
    parser.add_argument("--response-len", type=int, default=1024, help="tokens per response in the buffer case")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        jsonl, parquet = write_prompts(Path(tmp), args.lines)
        print(f"wrote {args.lines:,} prompts: {jsonl.stat().st_size / 2**20:.0f} MB JSONL, "
              f"{parquet.stat().st_size / 2**20:.0f} MB Parquet in {time.perf_counter() - t:.1f} s")
        print(f"batch: {args.batch} prompts x {args.n} samples, shuffled\n")
        header = (f"{'case':<34}{'open s':>8}{'read s':>9}{'(CPU s)':>9}{'total s':>9}{'RSS +MB':>9}"
                  f"{'peak +MB':>10}")
        print(header)
        print("-" * len(header))
        for name, case, path in [("JSONL: open + first batch", "first", jsonl),
                                 ("JSONL: open + resume mid-epoch", "resume", jsonl),
                                 ("JSONL: open + check every line", "check", jsonl),
                                 ("Parquet: open + first batch", "first", parquet),
                                 ("Parquet: open + resume mid-epoch", "resume", parquet),
                                 ("Parquet: open + check every row", "check", parquet)]:
            r = run(MEASURE, case, path, args.batch, args.n)
            print(f"{name:<34}{r['open_s']:>8.2f}{r['batch_s']:>9.2f}{r['batch_cpu_s']:>9.2f}"
                  f"{r['open_s'] + r['batch_s']:>9.2f}"
                  f"{r['rss_mb']:>9.0f}{r['peak_mb']:>10.0f}")
        groups = 64
        b = run(BUFFER, Path(tmp) / "buffer", groups, args.n, args.response_len)
        tokens = groups * args.n * (256 + args.response_len)
        print(f"\nbuffer: {groups} groups x {args.n} samples x {256 + args.response_len} tokens ({tokens:,} tokens): "
              f"add {b['add_s']:.2f} s (durable), take {b['take_s']:.2f} s, file {b['file_mb']:.0f} MB")
        print("targets: open + first batch < 10 s, RSS growth < 200 MB")


if __name__ == "__main__":
    main()
