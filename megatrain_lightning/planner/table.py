"""The plan as ``megatrain plan`` prints it: a table of every way of training, a legend, a recommendation."""

from __future__ import annotations

from megatrain_lightning.planner.plan import DTYPE_BYTES, GB, RESERVE, Plan, allowed, recommend, shortfalls
from megatrain_lightning.store.sizing import min_cache_bytes


def _gb(value: float) -> str:
    return f"{value:.1f}" if value >= 1 or value == 0 else f"{value:.2g}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


MEMORY_LEGEND = (
    "GPU GB: GPU memory used: plain AdamW fp32 weights, gradients, Adam state and activations;",
    "  ZeRO-Offload weights in the compute dtype and activations; megatrain its slots (a pool per block",
    "  size: every block's own slot when all fit) and activations.",
    "host GB: RAM used: ZeRO-Offload fp32 weights and Adam state; megatrain the store and gradients (host",
    "  tier, with the bf16 shadow of the weights under bf16 compute) or their cache (disk tier), = cache GB,",
    "  plus the gradient offload's two page-locked staging buffers (the largest block in fp32 each).",
    "  disk GB: the disk tier's files.",
)
CPU_MEMORY_LEGEND = (  # CPU only: one memory, so one column
    "host GB: RAM used, the CPU's activations included: plain AdamW fp32 weights, gradients and Adam state;",
    "  megatrain the store and gradients (host tier, with the bf16 shadow of the weights under bf16 compute;",
    "  blocks compute on them in place, without slots) or their cache (disk tier, = cache GB, and slots",
    "  in RAM for the 2 largest blocks). disk GB: the disk tier's files.",
)
LEGEND = (
    *MEMORY_LEGEND,
    "fits: within the machine less the reserve; for megatrain, at its least (slots for the 2 largest blocks,",
    "  the blocks in use). A row that does not fit shows that least need. tier, slots, prefetch, cache GB:",
    "  megatrain's settings.",
    "step >= s: a lower bound on one optimizer step, set by the slowest (bound) of compute, link, disk,",
    "  the host's AdamW (update: megatrain's and ZeRO-Offload's; CPU only, plain AdamW's too) and, data",
    "  parallel, the network.",
)
NETWORK_LEGEND = (  # data parallel only, as its column
    "network GB: what one rank's collectives receive per step (megatrain: each block all-gathered twice and",
    "  its gradients reduce-scattered once per micro-batch, fp32; plain AdamW: DDP's all-reduce).",
)


def _largest(plan: Plan) -> str:
    """The largest block and what it takes on the device; and the block that takes most there, where that
    is another one (under bf16 an embedding stays fp32 and may outweigh a larger decoder layer)."""
    m, dtype = plan.model, plan.workload.compute_dtype
    sizes = m.block_bytes(DTYPE_BYTES[dtype])
    largest = m.block_numels.index(m.largest_block)
    text = f"largest {_count(m.largest_block)} ({_gb(sizes[largest] / GB)} GB on the device in {dtype})"
    widest = sizes.index(max(sizes))
    if sizes[widest] > sizes[largest]:
        kept, nbytes = _count(m.fp32_numels[widest]), _gb(sizes[widest] / GB)
        text += (
            f"; largest on the device a block of {_count(m.block_numels[widest])} in {nbytes} GB (bf16-mixed "
            f"keeps its {kept} of embeddings, norms and biases in fp32)"
        )
    return text


def _memory(plan: Plan) -> str:
    """The machine's memories and the link between them (none where the CPU computes in its RAM)."""
    mach = plan.machine
    disk = f"{mach.disk_gb:g} GB disk"
    if mach.cpu:
        return f"CPU only: {mach.ram_gb:g} GB RAM (the device's memory too), {disk}; no link"
    return f"{mach.vram_gb:g} GB GPU, {mach.ram_gb:g} GB RAM, {disk}; link {mach.pcie_gbps:g} GB/s"


def format_plan(plan: Plan, lossiest: str | None = None) -> str:
    """The plan as a plain-text table, with one line each on the model, the machine and the workload, and
    the recommendation: a compression no lossier than ``lossiest`` (``None``: any), or why none fits."""
    m, mach, w = plan.model, plan.machine, plan.workload
    lines = [
        f"model: {_count(m.num_params)} params in {m.num_blocks} blocks, {_largest(plan)}; activations "
        f"{_gb(plan.activations_gb)} GB per micro-batch of {w.micro_tokens} tokens"
        + (" (per-block checkpointing)" if w.activation_checkpointing else ""),
        f"machine: {_memory(plan)}, disk {mach.disk_gbps:g} GB/s, {mach.tflops:g} TFLOP/s, host AdamW "
        f"{mach.update_gparams:g} G params/s; "
        f"{w.tokens_per_step} tokens per step in {w.micro_batches} micro-batch(es); "
        f"{RESERVE:.0%} of {'RAM' if mach.cpu else 'GPU and RAM'} kept in reserve",
        "",
    ]
    if mach.ranks > 1:
        lines[-1:-1] = [
            f"data parallel: {mach.ranks_per_node} rank(s) on each of {mach.nodes} node(s), {mach.ranks} in "
            f"all; network {mach.network_gbps:g} GB/s per rank; every figure below is one rank's (its "
            f"share of its node's RAM and disk), its tokens per step as above"
        ]
    gpu = () if mach.cpu else ("GPU GB",)  # CPU only: the device's memory is the RAM, counted under host GB
    header = (
        "method",
        *gpu,
        "host GB",
        "disk GB",
        "fits",
        "tier",
        "slots",
        "prefetch",
        "cache GB",
        "step >= s",
        "bound",
        *(("network GB",) if mach.ranks > 1 else ()),
    )
    table = [header]
    for r in plan.rows:
        s = r.settings
        table.append(
            (
                r.method,
                *(() if mach.cpu else (_gb(r.gpu_gb),)),
                _gb(r.host_gb),
                _gb(r.disk_gb),
                "yes" if r.fits else "no",
                s.tier if s else "-",
                str(s.num_slots) if s else "-",
                str(s.prefetch_depth) if s else "-",
                _gb(s.cache_gb) if s else "-",
                f"{r.step_s:.3g}",
                r.bound_by,
                *((_gb(r.network_gb),) if mach.ranks > 1 else ()),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        cells = [
            c.ljust(wd) if j == 0 else c.rjust(wd) for j, (c, wd) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    legend = (*CPU_MEMORY_LEGEND, *LEGEND[len(MEMORY_LEGEND) :]) if mach.cpu else LEGEND
    lines += ["", *legend, *(NETWORK_LEGEND if mach.ranks > 1 else ())]
    least = min_cache_bytes(m.largest_block, cuda=not mach.cpu)
    lines += ["", f"disk tier: `max_cpu_gb` >= {_gb(least / 1e9)} GB (the store chunks in use at once)."]
    best = recommend(plan, lossiest)
    lines.append("")
    if best is None or best.settings is None:
        lines.append(_does_not_fit(plan, lossiest))
    else:
        s = best.settings
        where = "in host RAM" if s.tier == "host" else f"on disk, {_gb(s.cache_gb)} GB cached in RAM"
        if not mach.cpu:
            held = f"{_gb(s.slot_gb)} GB; {_gb(best.gpu_gb)} GB on the GPU with activations"
            slots = f"{s.num_slots} slots ({held}), prefetch depth {s.prefetch_depth}"
        elif s.num_slots:
            slots = f"{s.num_slots} slots in RAM ({_gb(s.slot_gb)} GB), prefetch depth {s.prefetch_depth}"
        else:
            slots = "no slots (blocks compute on the store's weights)"
        ram = f"; {_gb(best.host_gb)} GB of RAM in all" if mach.cpu else ""
        lines.append(f"recommended: {best.method} with the store {where}, {slots}{ram}")
    return "\n".join(lines)


def _does_not_fit(plan: Plan, lossiest: str | None) -> str:
    """Why no allowed megatrain row fits: what the one needing least lacks (a disk not given named as such),
    and the least lossy compression that would fit, where ``lossiest`` ruled it out."""
    row = plan.row(f"megatrain {allowed(lossiest)[-1]}")
    needs = []
    for what, need, have in shortfalls(row, plan.machine):
        if what == "disk" and plan.machine.disk_gb == 0:
            needs.append(f"{_gb(need)} GB of disk for its disk tier, and no disk was given (--disk GB)")
        else:
            needs.append(f"{_gb(need)} GB of {what} ({_gb(have)} GB usable)")
    asked = "megatrain" if lossiest is None else f"megatrain with --compression {lossiest} (no lossier state)"
    lacks = " and ".join(needs) or "more than it has"
    line = f"{asked}: does not fit this machine: {row.method} needs {lacks}; "
    lossier = next((r for r in plan.rows if r.settings is not None and r.fits), None)  # the least lossy
    if lossiest is not None and lossier is not None:
        return line + f"{lossier.method} fits (--compression {lossier.method.split()[-1]} allows it)."
    return line + (
        "add RAM or a larger disk." if plan.machine.cpu else "add RAM, a larger disk or GPU memory."
    )
