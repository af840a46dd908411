# ruff: noqa: E501 - the HLO module below keeps its lines whole, as XLA writes them
"""What scripts/hlo_cost.py reads from a TPU-optimized HLO module: loop trip counts, matmul FLOPs (a dot, a
convolution, one whose lhs dilation zero-fills most taps, one whose window mostly covers padding), HBM bytes (plain ops, an async start, an in-place
update) and collectives inside and outside the loop, on a small module written out by hand."""

from __future__ import annotations

import pytest
from helpers import train_config

from scripts.hlo_cost import Collective, collective_seconds, parse_module, step_cost, trip_count

MODULE = """HloModule step, entry_computation_layout={()->()}

%add.clone (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%fused_matmul (param_0: bf16[64,128], param_1: bf16[128,256]) -> bf16[64,256] {
  %param_0 = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = bf16[128,256]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.1 = bf16[64,256]{1,0:T(8,128)(2,1)} convolution(%param_0, %param_1), window={size=1}, dim_labels=bf_io->bf
}

%fused_update (param_0.1: f32[4,256], param_1.1: f32[1,256], param_2: s32[]) -> f32[4,256] {
  %param_0.1 = f32[4,256]{1,0} parameter(0)
  %param_1.1 = f32[1,256]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %constant.9 = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[4,256]{1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2, %constant.9)
}

%body (p: (s32[], bf16[64,128], bf16[128,256])) -> (s32[], bf16[64,128], bf16[128,256]) {
  %p = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %a = bf16[64,128]{1,0} get-tuple-element(%p), index=1
  %b = bf16[128,256]{1,0} get-tuple-element(%p), index=2
  %fusion.1 = bf16[64,256]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_matmul
  %all-reduce.1 = bf16[64,256]{1,0} all-reduce(%fusion.1), channel_id=1, replica_groups=[1,8]<=[8], to_apply=%add.clone
  %dot.1 = f32[64,64]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%next, %a, %b)
}

%cond (q: (s32[], bf16[64,128], bf16[128,256])) -> pred[] {
  %q = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) parameter(0)
  %limit = s32[] constant(4)
  %j = s32[] get-tuple-element(%q), index=0
  ROOT %lt = pred[] compare(%j, %limit), direction=LT
}

ENTRY %main (in_a: bf16[64,128], in_b: bf16[128,256], acc: f32[4,256], row: f32[1,256], k: s32[], heads: bf16[8,64,128], kern: bf16[8,128,64], x4: bf16[4,16,768,1], w4: bf16[12,64,768,1]) -> f32[4,256] {
  %in_a = bf16[64,128]{1,0} parameter(0)
  %in_b = bf16[128,256]{1,0} parameter(1)
  %acc = f32[4,256]{1,0} parameter(2)
  %row = f32[1,256]{1,0} parameter(3)
  %k = s32[] parameter(4)
  %heads = bf16[8,64,128]{2,1,0} parameter(5)
  %kern = bf16[8,128,64]{2,1,0} parameter(6)
  %x4 = bf16[4,16,768,1]{3,2,1,0} parameter(7)
  %w4 = bf16[12,64,768,1]{3,2,1,0} parameter(8)
  %per_head = bf16[4,16,12,64]{3,2,1,0} convolution(%x4, %w4), window={size=1x12 pad=0_0x11_11 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) tuple(%zero, %in_a, %in_b)
  %loop = (s32[], bf16[64,128]{1,0}, bf16[128,256]{1,0}) while(%init), condition=%cond, body=%body
  %scores = bf16[8,64,64]{2,1,0} convolution(%heads, %kern), window={size=8 stride=7 lhs_dilate=8}, dim_labels=0bf_0io->0bf
  %copy-start.1 = (f32[4,256]{1,0}, f32[4,256]{1,0}, u32[]) copy-start(%acc)
  %fusion.2 = f32[4,256]{1,0} fusion(%acc, %row, %k), kind=kLoop, calls=%fused_update
  %all-gather.1 = f32[32,256]{1,0} all-gather(%fusion.2), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %out = f32[4,256]{1,0} negate(%fusion.2)
}
"""


def test_a_loops_trip_count_is_its_conditions_bound():
    computations = parse_module(MODULE)
    assert trip_count(computations["cond"]) == 4
    assert trip_count(computations["body"]) is None  # no bounded compare: not a loop condition


def test_matmul_flops_count_each_loop_run_and_drop_the_taps_on_dilation_zeros():
    cost = step_cost(MODULE, peak_flops=1e12, hbm_bytes_per_s=1e9)
    assert cost.loops == {"body": 4}
    in_loop = 4 * (2 * 64 * 256 * 128 + 2 * 64 * 64 * 128)  # the fused convolution and the dot, 4 runs
    # The dilated convolution (a batched matmul as XLA:TPU writes one): its kernel bf16[8,128,64] labelled 0io,
    # so 8 x 128 taps per output element, of which the lhs dilation of 8 leaves 128 on real values.
    dilated = 2 * (8 * 64 * 64) * 128
    # A per-head projection: its window of 12 along a dimension of size 1 padded by 11 each side meets one real
    # value, so each output element is 768 multiply-adds (not 12 x 768).
    per_head = 2 * (4 * 16 * 12 * 64) * 768
    assert cost.flops == pytest.approx(in_loop + dilated + per_head)


def test_hbm_bytes_count_an_async_start_and_an_in_place_update_by_what_they_write():
    cost = step_cost(MODULE, peak_flops=1e30, hbm_bytes_per_s=1.0)  # bytes bound: the roofline is the bytes
    fusion_1 = 64 * 128 * 2 + 128 * 256 * 2 + 64 * 256 * 2
    dot_1 = 64 * 128 * 2 * 2 + 64 * 64 * 4
    next_add = 3 * 4
    scores = 8 * 64 * 128 * 2 + 8 * 128 * 64 * 2 + 8 * 64 * 64 * 2
    copy_start = 2 * (4 * 256 * 4 + 4)  # its result less the operand it carries: the copy (and the u32), twice
    update = 2 * (256 * 4 + 4)  # the row and the index, read and written: the accumulator is updated in place
    negate = 2 * 4 * 256 * 4
    per_head = 2 * (4 * 16 * 768 + 12 * 64 * 768 + 4 * 16 * 12 * 64)
    assert cost.hbm_bytes == 4 * (fusion_1 + dot_1 + next_add) + scores + per_head + copy_start + update + negate
    assert cost.roofline_ops_s == pytest.approx(cost.hbm_bytes)


def test_collectives_are_told_apart_inside_and_outside_the_loop_with_their_bytes_and_runs():
    cost = step_cost(MODULE, peak_flops=1e12, hbm_bytes_per_s=1e9)
    assert [(c.kind, c.bytes, c.in_loop, c.runs) for c in cost.collectives] == [
        ("all-reduce", 64 * 256 * 2, True, 4), ("all-gather", 32 * 256 * 4, False, 1)]
    # A ring all-reduce moves 2(n-1)/n of its bytes through each chip; an all-gather (n-1)/n of the whole.
    assert collective_seconds(Collective("all-reduce", 800, True, 1), 8, 100.0) == pytest.approx(14.0)
    assert collective_seconds(Collective("all-gather", 800, False, 1), 8, 100.0) == pytest.approx(7.0)


KERNEL_MODULE = """HloModule step, entry_computation_layout={()->()}

%body (p: (s32[], bf16[8,4,128,64])) -> (s32[], bf16[8,4,128,64]) {
  %p = (s32[], bf16[8,4,128,64]{3,2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %q = bf16[8,4,128,64]{3,2,1,0} get-tuple-element(%p), index=1
  %custom-call.1 = (bf16[8,4,128,64]{3,2,1,0}, f32[8,4,128,128]{3,2,1,0}) custom-call(%q, %q, %q), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "TUxJUgA="}}
  %o = bf16[8,4,128,64]{3,2,1,0} get-tuple-element(%custom-call.1), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[8,4,128,64]{3,2,1,0}) tuple(%next, %o)
}

%cond (c: (s32[], bf16[8,4,128,64])) -> pred[] {
  %c = (s32[], bf16[8,4,128,64]{3,2,1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %limit), direction=LT
}

ENTRY %main (x: bf16[8,4,128,64]) -> bf16[8,4,128,64] {
  %x = bf16[8,4,128,64]{3,2,1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,4,128,64]{3,2,1,0}) tuple(%zero, %x)
  %w = (s32[], bf16[8,4,128,64]{3,2,1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[8,4,128,64]{3,2,1,0} get-tuple-element(%w), index=1
}
"""


def test_a_pallas_kernel_is_counted_apart_its_calls_and_bytes_with_the_loops_trips():
    cost = step_cost(KERNEL_MODULE, peak_flops=1e12, hbm_bytes_per_s=1e9)
    qkv = 8 * 4 * 128 * 64 * 2
    assert cost.kernel_calls == 3  # one a trip, 3 trips
    assert cost.kernel_bytes == 3 * (3 * qkv + qkv + 8 * 4 * 128 * 128 * 4)  # q, k, v in; out and the f32 residual
    assert cost.flops == 0 and cost.hbm_bytes < qkv  # opaque: none of it in the ops' FLOPs or bytes


def test_the_ops_listed_add_up_to_the_roofline_and_come_longest_first():
    from scripts.hlo_cost import top_ops

    cost = step_cost(MODULE, peak_flops=1e12, hbm_bytes_per_s=1e9)
    assert sum(o.roofline_s for o in cost.ops) == pytest.approx(cost.roofline_ops_s)
    assert sum(o.hbm_bytes for o in cost.ops) == pytest.approx(cost.hbm_bytes)
    listed = top_ops(cost, 3)
    assert len(listed) == 3 and [o.roofline_s for o in listed] == sorted((o.roofline_s for o in cost.ops),
                                                                          reverse=True)[:3]
    loop_op = next(o for o in cost.ops if o.name == "fusion.1")
    assert loop_op.runs == 4 and loop_op.flops == pytest.approx(4 * 2 * 64 * 128 * 256)  # the loop's 4 trips


@pytest.mark.parametrize("peak, total, fits", [(0, 0, False), (15 * 2**30, 0, True), (0, int(14.9 * 2**30), True)])
def test_the_compilers_own_total_decides_the_fit_and_the_summed_buffers_only_where_it_gave_none(tmp_path, peak, total,
                                                                                               fits):
    """libtpu 0.0.17 reports no peak of its own (0), and get_compiled_memory_stats' buffers count more than the
    compiler does (gpt2-xl with fsdp on v5e-8: 17.2 GiB summed, 14.9 GiB in its memory-usage report, and compiled).
    The compiler's peak decides where it gives one, else its report's total; the sum only where neither is there."""
    import json

    from scripts.tpu_compile_step import analyse, report_lines

    (tmp_path / "step.json").write_text(json.dumps({
        "train": train_config(preset="tiny").to_dict(), "micro_batch": 8, "grad_accum_steps": 4,
        "attention": "pallas-flash", "activation_checkpointing": True, "scan_layers": False}))
    gib = 2**30
    memory = {"arguments": int(8.65 * gib), "outputs": int(8.65 * gib), "aliased": int(8.65 * gib),
              "temps": int(8.11 * gib), "code": int(0.05 * gib), "host_temps": 0, "peak": peak,
              "compiler_total": total}
    (tmp_path / "compiled.json").write_text(json.dumps({
        "device_kind": "TPU v5 lite", "devices": 8, "topology": "v5e:2x4", "compile_s": 130.0, "jax": "0.7.2",
        "libtpu": "0.0.17", "memory": memory}))
    (tmp_path / "optimized.hlo.txt").write_text(MODULE)
    report = analyse(tmp_path, "v5e-8")
    assert report["fits"] is fits and report["hbm_bytes"] == 16 * gib
    lines = report_lines(report)
    if fits and peak:
        assert lines[1] == "HBM per chip: 15.0 GiB of 16 GiB (fits, 6% free)" and "its peak 15.00 GiB" in lines[2]
    elif fits:
        assert lines[1] == "HBM per chip: 14.9 GiB of 16 GiB (fits, 7% free)"
        assert lines[2].endswith("its memory-usage report's total 14.90 GiB")
    else:
        assert lines[1] == "HBM per chip: 16.8 GiB of 16 GiB (does not fit, 0.81 GiB over)"
        assert lines[2].endswith("no peak reported: their sum stands for it")


def test_the_compilers_total_is_read_from_the_largest_memory_usage_report_of_its_dump(tmp_path):
    from scripts.tpu_compile_libtpu import compiler_total_bytes

    assert compiler_total_bytes(tmp_path) == 0  # no report: nothing to read
    (tmp_path / "module_0001.small.after_optimizations-memory-usage-report.txt").write_text(
        "Total bytes used: 1024 (1.00KiB)\n")
    (tmp_path / "module_0003.step.after_optimizations-memory-usage-report.txt").write_text(
        "Total bytes used: 15997863120 (14.90GiB)\n\nAllocations sorted by size:\n" + "allocation 1: size 1\n" * 50)
    (tmp_path / "module_0003.step.after_optimizations-buffer-assignment.txt").write_text("Total bytes used: 7\n" * 99)
    assert compiler_total_bytes(tmp_path) == 15997863120


@pytest.mark.parametrize("head_dim, width, factor", [(64, 128, 2), (64, 256, 4), (128, 128, 1), (256, 128, 1)])
def test_a_pallas_kernels_flops_take_longer_by_the_mxu_share_its_head_dim_leaves_empty(head_dim, width, factor):
    from scripts.hlo_cost import kernel_seconds, mxu_efficiency

    cost = step_cost(KERNEL_MODULE, peak_flops=1e12, hbm_bytes_per_s=1e9)
    flops = 1e12  # 1 s at peak, far longer than the kernels' 4.7 MB at 1 GB/s
    full = kernel_seconds(flops, cost.kernel_bytes, 1e12, 1e9)
    assert full == pytest.approx(1.0)
    assert kernel_seconds(flops, cost.kernel_bytes, 1e12, 1e9, mxu_efficiency(head_dim, width)) == \
        pytest.approx(factor * full)
    # Bound by their bytes, the kernels take as long at any MXU share: the bytes do not depend on it.
    assert kernel_seconds(1e6, cost.kernel_bytes, 1e12, 1e9, mxu_efficiency(head_dim, width)) == \
        pytest.approx(cost.kernel_bytes / 1e9)


@pytest.mark.parametrize("tpu, factor", [("v5e-8", 4), ("v6e-8", 8)])
def test_the_report_gives_the_ceiling_both_ways_with_the_kernels_slower_by_the_head_dims_mxu_share(tmp_path, tpu,
                                                                                                  factor):
    """tiny's head dim 32: a quarter of v5e's 128-wide MXU, an eighth of v6e's 256-wide one."""
    import json

    from scripts.tpu_compile_step import analyse, report_lines

    (tmp_path / "step.json").write_text(json.dumps({
        "train": train_config(preset="tiny").to_dict(), "micro_batch": 8, "grad_accum_steps": 3,
        "attention": "pallas-splash", "activation_checkpointing": False, "scan_layers": False}))
    memory = {"arguments": 2**20, "outputs": 2**20, "aliased": 2**20, "temps": 2**20, "code": 0, "host_temps": 0,
              "peak": 2**22, "compiler_total": 0}
    (tmp_path / "compiled.json").write_text(json.dumps({
        "device_kind": "TPU v5 lite", "devices": 8, "topology": "v5e:2x4", "compile_s": 1.0, "jax": "0.7.2",
        "libtpu": "0.0.17", "memory": memory}))
    (tmp_path / "optimized.hlo.txt").write_text(KERNEL_MODULE)
    r = analyse(tmp_path, tpu)
    assert r["kernel_calls"] == 3 and r["head_dim"] == 32 and r["mxu_efficiency"] == pytest.approx(1 / factor)
    assert r["kernel_mxu_s"] == pytest.approx(factor * r["kernel_s"])  # FLOPs-bound: the kernels' bytes are few
    assert r["step_mxu_s"] - r["step_s"] == pytest.approx((factor - 1) * r["kernel_s"])
    assert r["mfu_ceiling_mxu"] == pytest.approx(r["mfu_ceiling"] * r["step_s"] / r["step_mxu_s"])
    lines = report_lines(r)
    assert lines[-2] == f"MFU ceiling: {r['mfu_ceiling']:.1%}"
    assert lines[-1].startswith(f"MFU ceiling with the Pallas kernels' matmuls at head dim 32's share of a "
                                f"{128 if tpu == 'v5e-8' else 256}-wide MXU ({1 / factor:.0%}; ")
    assert f": {r['mfu_ceiling_mxu']:.1%} (kernels" in lines[-1]


def test_a_collective_reached_through_a_call_from_a_loop_body_whose_header_holds_a_comment_is_inside_the_loop():
    """A body's header with a `/*index=5*/` comment (XLA writes them in long tuples) and an all-reduce in a
    computation the body calls: both are the loop's."""
    hlo = """HloModule step
%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %r = f32[] add(f32[] %a, f32[] %b)
}
%inner (p: f32[768,2304]) -> f32[768,2304] {
  ROOT %ar.1 = f32[768,2304]{1,0} all-reduce(f32[768,2304]{1,0} %p), replica_groups={}, to_apply=%add
}
%body (t: (s32[], f32[], f32[], f32[], f32[], /*index=5*/f32[768,2304])) -> (s32[], f32[768,2304]) {
  %c = f32[768,2304]{1,0} call(f32[768,2304]{1,0} %x), to_apply=%inner
  %ar.2 = bf16[10]{0} all-reduce(bf16[10]{0} %y), to_apply=%add
  ROOT %t2 = (s32[], f32[768,2304]) tuple(%i, %c)
}
%cond (t: (s32[], f32[768,2304])) -> pred[] {
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}
ENTRY %main (a: f32[768]) -> f32[768] {
  %w = (s32[], f32[768,2304]) while((s32[], f32[768,2304]) %init), condition=%cond, body=%body
  ROOT %ar.3 = f32[768]{0} all-reduce(f32[768]{0} %a), to_apply=%add
}
"""
    cost = step_cost(hlo, peak_flops=1e12, hbm_bytes_per_s=1e9)
    assert [(c.kind, c.bytes, c.in_loop) for c in cost.collectives] == [
        ("all-reduce", 768 * 2304 * 4, True), ("all-reduce", 10 * 2, True), ("all-reduce", 768 * 4, False)]
