"""benchmarks/fp8_rollout.py's gemm rows as its table and printed lines show them: CUDA-graph microseconds beside
the eager ones, a capture error in place of the graphed figures, and JSON from before the graphed timing ('-').
(The GPU side, `bench-fp8-gemm`, needs SGLang and a GPU; the rollout and sync modes on the CPU:
tests/e2e/test_fp8_bench.py.)"""

from __future__ import annotations

from script_imports import benchmark

bench = benchmark("fp8_rollout")
LAYERS = list(bench.GEMM_SHAPES)


def rows(backend: str, graphed: bool = True, graph_error: str | None = None) -> list[dict]:
    out = []
    for m in (256, 8192):
        for i, layer in enumerate(LAYERS):
            n, k = bench.GEMM_SHAPES[layer]
            row = {"mode": "gemm", "backend": backend, "layer": layer, "m": m, "n": n, "k": k, "rel_err": 1e-3,
                   "us": 155.0 + i, "bf16_us": 20.0 + i, "runner": "triton_w8a8_block_fp8_linear"}
            if graphed:
                row |= {"graph_us": 10.0 * (i + 1) + m // 256, "bf16_graph_us": 8.0 * (i + 1)}
            if graph_error:
                row |= {"graph_error": graph_error, "bf16_graph_us": 8.0}
            out.append(row)
    return out


def table_lines(gemms: list[dict], capsys) -> dict[str, list[str]]:
    bench.table(gemms)
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("| --fp8-gemm-backend"))
    assert [c.strip() for c in header.strip("|").split("|")][3:] == [
        "decode (256 rows) eager", "decode graphed", "prefill (8192 rows) eager", "prefill graphed"]
    return {cells[0]: cells[1:] for line in printed.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_the_gemm_table_shows_graphed_figures_beside_eager_and_dashes_for_old_json(capsys):
    error = "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    gemms = (rows("triton") + rows("old-json", graphed=False) + rows("no-capture", graphed=False, graph_error=error)
             + [{"mode": "gemm", "backend": "deep_gemm", "layer": "qkv_proj", "m": 256, "n": 4608, "k": 3584,
                 "error": "ImportError: deep_gemm"}])
    shown = table_lines(gemms, capsys)
    assert shown["triton"] == ["yes", "triton_w8a8_block_fp8_linear", "155/20, 156/21, 157/22, 158/23",
                               "11/8, 21/16, 31/24, 41/32", "155/20, 156/21, 157/22, 158/23",
                               "42/8, 52/16, 62/24, 72/32"]
    assert shown["old-json"][2:] == ["155/20, 156/21, 157/22, 158/23", "-", "155/20, 156/21, 157/22, 158/23", "-"]
    assert shown["no-capture"][2:] == ["155/20, 156/21, 157/22, 158/23", f"no: {error}",
                                       "155/20, 156/21, 157/22, 158/23", f"no: {error}"]
    assert shown["deep_gemm"] == ["no: ImportError: deep_gemm", "-", "-", "-", "-", "-"]


def test_a_layer_without_figures_keeps_its_place_in_the_cell(capsys):
    gemms = rows("triton")
    del gemms[1]["graph_us"]  # o_proj at 256 rows: not graphed
    gemms[2] = {k: v for k, v in gemms[2].items() if k not in ("us", "bf16_us")} | {"error": "x"}
    shown = table_lines(gemms, capsys)
    assert shown["triton"][2:4] == ["155/20, 156/21, -, 158/23", "11/8, -, 31/24, 41/32"]


def test_the_printed_line_shows_eager_and_graphed():
    row = rows("triton")[0]
    assert bench.gemm_line(row) == ("triton_w8a8_block_fp8_linear: rel err 1.00e-03, eager 155 us (bf16 20 us),"
                                    " graphed 11 us (bf16 8 us)")
    failed = rows("x", graphed=False, graph_error="RuntimeError: capture")[0]
    assert bench.gemm_line(failed).endswith("eager 155 us (bf16 20 us), graphed: RuntimeError: capture")
    assert bench.gemm_line({"error": "ImportError: deep_gemm"}) == "ImportError: deep_gemm"
    channel = rows(bench.CHANNEL)[0] | {"core_fp8_bytes_differ": 0.00125, "core_scale_max_rel": 6e-8}
    assert bench.gemm_line(channel).endswith("graphed 11 us (bf16 8 us); against core's quantize_channel: 0.125% "
                                             "of bytes differ, scales within 6.0e-08")
    unchecked = rows(bench.CHANNEL)[0] | {"core_error": "ImportError: sgl_kernel"}
    assert bench.gemm_line(unchecked).endswith("; core: ImportError: sgl_kernel")
