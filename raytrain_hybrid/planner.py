"""Cost model of one training step per rank: memory, compute, communication, bubble.

Sources of the formulas (cited where used):
- ZeRO memory: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models" (SC'20), section 3: mixed-precision Adam holds 2 + 2 + 12 bytes/param.
- Activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models" (MLSys'23), eqs. 1-4: s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit, divided by t
  under TP (+SP), 2*s*b*h with full recomputation.
- Pipeline bubble and in-flight micro-batches: Narayanan et al., "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM" (SC'21), sections 2.2 and 3.
- FLOPs per token: raytrain_hybrid.flops (6N + attention).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from raytrain_hybrid.config import Config, validate
from raytrain_hybrid.errors import ConfigError
from raytrain_hybrid.flops import flops_per_token, tokens_per_row

GiB = 1024**3


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    gpus_per_node: int
    memory_bytes: float  # per device
    peak_tflops: float  # dense, in the training dtype
    efficiency: float  # fraction of peak a well-fed matmul-heavy step reaches
    intra_node_gbps: float  # GB/s per device per direction (NVLink / shared memory)
    inter_node_gbps: float  # GB/s per device per direction (InfiniBand / network)
    latency_s: float = 10e-6  # per collective or P2P message
    # CPU profiles (calibrate): cores the ranks share (0: one device per rank), and the
    # measured cost of one TP column/row pair beyond its compute (DTensor dispatch + gloo).
    cores: int = 0
    tp_pair_overhead_s: float = 0.0


# NVIDIA datasheets: H100 SXM5 989 TFLOP/s dense BF16, 80 GB HBM3, NVLink 4 900 GB/s
# bidirectional (450 per direction); DGX H100: 8 x 400 Gb/s NDR InfiniBand (50 GB/s per GPU).
# A100 SXM4 312 TFLOP/s dense BF16, NVLink 3 600 GB/s bidirectional (300 per direction);
# DGX A100: 8 x 200 Gb/s HDR InfiniBand (25 GB/s per GPU). Efficiency 0.5: Megatron-LM reports
# 44-52 % of peak on large GPT runs (Narayanan et al. 2021, table 1).
PROFILES = {
    "h100": Hardware(
        name="H100-80GB SXM",
        gpus_per_node=8,
        memory_bytes=80e9,
        peak_tflops=989.0,
        efficiency=0.5,
        intra_node_gbps=450.0,
        inter_node_gbps=50.0,
    ),
    # torchtitan's published runs (Grand Teton): H100 with 96 GB HBM2e (95 GiB usable), 500 W,
    # 400 Gb/s RDMA per GPU (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md).
    "h100-96": Hardware(
        name="H100-96GB HBM2e",
        gpus_per_node=8,
        memory_bytes=95 * 1024**3,
        peak_tflops=989.0,
        efficiency=0.5,
        intra_node_gbps=450.0,
        inter_node_gbps=50.0,
    ),
    "a100-80": Hardware(
        name="A100-80GB SXM",
        gpus_per_node=8,
        memory_bytes=80e9,
        peak_tflops=312.0,
        efficiency=0.5,
        intra_node_gbps=300.0,
        inter_node_gbps=25.0,
    ),
    "a100-40": Hardware(
        name="A100-40GB SXM",
        gpus_per_node=8,
        memory_bytes=40e9,
        peak_tflops=312.0,
        efficiency=0.5,
        intra_node_gbps=300.0,
        inter_node_gbps=25.0,
    ),
}


def load_hardware(name: str) -> Hardware:
    if name in PROFILES:
        return PROFILES[name]
    path = Path(name)
    if not path.is_file():
        raise ConfigError(
            "--hardware",
            name,
            f"is neither a built-in profile {sorted(PROFILES)} nor a file (make one with `raytrain-hybrid calibrate`)",
        )
    return Hardware(**json.loads(path.read_text()))


def _has_sp(model) -> bool:
    """Whether the architecture has a sequence-parallel plan (BERT's post-LN blocks do not)."""
    from raytrain_hybrid.models import get_arch

    return bool(get_arch(model.arch).sp_plan)


def num_blocks(model) -> int:
    from raytrain_hybrid.models import get_arch

    return get_arch(model.arch).num_blocks(model)


def bert_embedding_params(model) -> int:
    """One BERT encoder's embeddings: words, 512 positions, 2 token types, LayerNorm."""
    h = model.hidden_size
    return model.vocab_size * h + max(512, model.seq_len) * h + 2 * h + 2 * h


def param_parts(model) -> tuple[int, int, int]:
    """(per block, first stage extra: embeddings, last stage extra: final norm + head).
    multimodal-bert: the first stage's extra is encoder A's embeddings and the tabular
    network; encoder B's embeddings sit with its first block (max_rank_params)."""
    h, f, v = model.hidden_size, model.ffn_hidden_size, model.vocab_size
    if model.arch == "multimodal-bert":
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # BERT block: like GPT-2's
        th, fh = model.tabular_hidden_size, model.fusion_hidden_size
        tabular = 3 * th + th + th * th + th  # three features is the shipped set's width
        head = (2 * h + th) * fh + fh + fh * model.num_classes + model.num_classes
        return per_layer, bert_embedding_params(model) + tabular, head
    if model.arch == "gpt2":
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # qkv+o with biases, mlp, 2 LayerNorms
        return per_layer, v * h + model.seq_len * h, 2 * h + v * h
    kv = model.num_kv_heads * (h // model.num_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # attention, gated MLP, 2 RMSNorms
    return per_layer, v * h, h + v * h


def param_count(model) -> int:
    """All parameters of the model as built (untied embedding and head)."""
    per_layer, first, last = param_parts(model)
    second = bert_embedding_params(model) if model.arch == "multimodal-bert" else 0
    return num_blocks(model) * per_layer + first + last + second


def max_rank_params(cfg: Config) -> float:
    """Parameters on the fullest pipeline rank, before TP/DP sharding (stages are uneven)."""
    from raytrain_hybrid.distributed.pipeline import split_layers, stage_ids

    par = cfg.parallelism
    if par.pp == 1:
        return float(param_count(cfg.model))
    per_layer, first, last = param_parts(cfg.model)
    split = split_layers(num_blocks(cfg.model), par.num_stages)
    # multimodal-bert: encoder B's embeddings live with its first block.
    anchored = cfg.model.num_layers if cfg.model.arch == "multimodal-bert" else None
    best = 0.0
    for rank in range(par.pp):
        ids = stage_ids(par.schedule, rank, par.pp, par.stages_per_rank)
        n = sum(len(split[i]) * per_layer for i in ids)
        n += first if 0 in ids else 0
        n += last if par.num_stages - 1 in ids else 0
        if anchored is not None and any(anchored in split[i] for i in ids):
            n += bert_embedding_params(cfg.model)
        best = max(best, n)
    return best


def state_bytes(phi: float, *, zero: int, dp: int, scheme: str = "fp32") -> dict[str, float]:
    """Parameter, gradient and optimizer bytes per rank for phi parameters on this rank's
    model share, data-parallel degree dp (ZeRO paper, section 3).

    scheme "mixed": 16-bit parameters and gradients, fp32 master + Adam moments (2 + 2 + 12).
    scheme "fp32": what this project keeps, fp32 parameters (bf16 only in autocast), fp32
    gradients, Adam moments (4 + 4 + 8).
    """
    p, g, o = (2.0, 2.0, 12.0) if scheme == "mixed" else (4.0, 4.0, 8.0)
    return {
        "params": p * phi / (dp if zero >= 3 else 1),
        "grads": g * phi / (dp if zero >= 2 else 1),
        "optimizer": o * phi / (dp if zero >= 1 else 1),
    }


def in_flight_microbatches(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """Micro-batches whose activations the first stage holds at its peak (Narayanan et al. 2021)."""
    if pp == 1:
        return 1.0
    if schedule == "GPipe":
        return float(microbatches)
    base = float(min(microbatches, pp))
    return base * (1 + (pp - 1) / (pp * virtual)) if virtual > 1 else base


def layer_activation_bytes(s: int, b: int, h: int, t: int, *, sp: bool, checkpointed: bool) -> float:
    """16-bit activation bytes one transformer layer keeps for backward (Korthikanti et al.
    2022, eqs. 2-5). The attention-score term 5*a*s/h of the paper is left out: sdpa's flash /
    memory-efficient kernels recompute scores in backward instead of storing them (the paper's
    "selective recomputation" gets the same). TP without SP: 10 + 24/t per s*b*h (norms,
    dropout masks and the residual stream stay whole on every TP rank); with SP: 34/t;
    full recomputation keeps only each layer's input, 2*s*b*h (/t with SP)."""
    if checkpointed:
        return 2.0 * s * b * h / (t if sp else 1)
    return s * b * h * (34.0 / t if sp else 10.0 + 24.0 / t)


def activation_bytes(cfg: Config, micro_batch: int) -> float:
    m, par = cfg.model, cfg.parallelism
    s, b, h, t = m.seq_len, micro_batch, m.hidden_size, par.tp
    sp = t > 1 and par.sequence_parallel and _has_sp(m)
    width = 2.0 if cfg.train.dtype == "bfloat16" else 4.0  # the formula counts 2-byte activations
    per_layer = layer_activation_bytes(s, b, h, t, sp=sp, checkpointed=par.activation_checkpointing)
    layers_per_rank = num_blocks(m) / par.pp
    in_flight = in_flight_microbatches(par.schedule, par.pp, par.microbatches, par.stages_per_rank if par.pp > 1 else 1)
    stash = per_layer * (width / 2) * layers_per_rank * in_flight
    if par.activation_checkpointing:  # the layer being recomputed holds its full activations
        stash += layer_activation_bytes(s, b, h, t, sp=sp, checkpointed=False) * (width / 2)
    logits = 2 * 4.0 * b * s * m.vocab_size  # fp32 logits and their gradient, gathered on the last stage
    if m.arch == "multimodal-bert":  # a class per row, not a vocabulary per token
        logits = 2 * 4.0 * b * m.num_classes
    return stash + logits


def _allreduce_s(nbytes: float, n: int, gbps: float, latency: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / (gbps * 1e9) + 2 * (n - 1) * latency


def predict(cfg: Config, hw: Hardware) -> dict:
    """Per-rank memory, step time, tokens/s, MFU and bubble of one layout."""
    m, par, t = cfg.model, cfg.parallelism, cfg.train
    dp, tp, pp, mb = par.dp, par.tp, par.pp, par.microbatches
    virtual = par.stages_per_rank if pp > 1 else 1
    micro_batch = t.global_batch_size // (dp * mb)
    phi = max_rank_params(cfg) / tp
    states = state_bytes(phi, zero=par.zero, dp=dp)
    act = activation_bytes(cfg, micro_batch)
    memory = {**states, "activations": act}
    memory["total"] = sum(memory.values())

    tokens = t.global_batch_size * tokens_per_row(m)
    flops = flops_per_token(m) * tokens / (dp * tp * pp)
    if par.activation_checkpointing:
        flops *= 4 / 3  # one more forward
    compute = flops / (hw.peak_tflops * 1e12 * hw.efficiency)
    world = dp * tp * pp
    # More ranks than cores: each rank gets cores/world of a core, and a rank idle in a
    # pipeline bubble hands its core to another, so the bubble costs no time.
    oversubscribed = bool(hw.cores) and world > hw.cores
    share = world / hw.cores if oversubscribed else 1.0
    compute *= share

    width = 2.0 if t.dtype == "bfloat16" else 4.0
    act_msg = micro_batch * m.seq_len * m.hidden_size * width
    layers_per_rank = num_blocks(m) / pp
    # TP: two all-reduces forward and two backward per block and micro-batch, inside a node.
    tp_s = 4 * layers_per_rank * mb * _allreduce_s(act_msg, tp, hw.intra_node_gbps, hw.latency_s)
    if tp > 1:  # attention and MLP are one column/row pair each
        tp_s += 2 * layers_per_rank * mb * hw.tp_pair_overhead_s * (tp / 2) * share
    # Placement fills nodes TP-first, then DP, then PP: an axis leaves the node once the
    # product of the axes inside it exceeds the node.
    dp_link = hw.intra_node_gbps if tp * dp <= hw.gpus_per_node else hw.inter_node_gbps
    pp_link = hw.intra_node_gbps if tp * dp * pp <= hw.gpus_per_node else hw.inter_node_gbps
    pp_s = 0.0 if pp == 1 else 2 * mb * virtual * (act_msg / (pp_link * 1e9) + hw.latency_s)
    grad_bytes = phi * 4.0
    dp_s = _allreduce_s(grad_bytes, dp, dp_link, hw.latency_s) * (1.5 if par.zero == 3 else 1.0)
    # Buckets overlap with the backward (2/3 of compute) on devices; on shared cores the
    # reduction takes CPU from the same cores and does not hide.
    dp_exposed = dp_s * share if oversubscribed else max(0.0, dp_s - 0.5 * compute)

    bubble = (pp - 1) / (mb * virtual + pp - 1) if pp > 1 else 0.0
    step = (compute + tp_s + pp_s) / (1 if oversubscribed else 1 - bubble) + dp_exposed
    tokens_per_s = tokens / step
    achieved = flops_per_token(m) * tokens_per_s / (dp * tp * pp) / 1e12
    return {
        "memory_bytes": memory,
        "predicted_step_s": step,
        "predicted_tokens_per_s": tokens_per_s,
        "predicted_mfu": achieved / hw.peak_tflops,
        "bubble_fraction": bubble,
        "time_s": {"compute": compute, "tp": tp_s, "pp": pp_s, "dp": dp_s, "dp_exposed": dp_exposed},
    }


def _microbatch_counts(per_replica: int) -> list[int]:
    """Micro-batches per replica: every divisor of the replica's batch, down to one sequence
    per micro-batch (the validator then drops counts a schedule refuses)."""
    return [d for d in range(1, per_replica + 1) if per_replica % d == 0]


def _candidates(world: int, cfg: Config, gpus_per_node: int, fixed: dict):
    def allowed(key, values):
        return [v for v in values if key not in fixed or fixed[key] == v]

    divisors = [d for d in range(1, world + 1) if world % d == 0]
    has_sp = _has_sp(cfg.model)
    for tp in allowed("tp", [d for d in divisors if d <= gpus_per_node]):
        for pp in allowed("pp", [d for d in divisors if (world // tp) % d == 0]):
            dp = world // (tp * pp)
            if "dp" in fixed and fixed["dp"] != dp or cfg.train.global_batch_size % dp:
                continue
            schedules = ["1F1B"] if pp == 1 else ["GPipe", "1F1B", "Interleaved1F1B"]
            for schedule in allowed("schedule", schedules):
                for mb in allowed("microbatches", _microbatch_counts(cfg.train.global_batch_size // dp)):
                    for zero in allowed("zero", [0] if dp == 1 else [0, 1, 2, 3]):
                        for ac in allowed("activation_checkpointing", [False, True]):
                            for sp in allowed("sequence_parallel", [True, False] if tp > 1 and has_sp else [False]):
                                yield {
                                    "dp": dp,
                                    "tp": tp,
                                    "pp": pp,
                                    "schedule": schedule,
                                    "microbatches": mb,
                                    "zero": zero,
                                    "activation_checkpointing": ac,
                                    "sequence_parallel": sp,
                                }


def plan(cfg: Config, world: int, hw: Hardware, fixed: dict | None = None) -> list[dict]:
    """Every layout of ``world`` ranks the validator accepts, best predicted tokens/s first,
    infeasible (out of memory) last with the reason. ``fixed`` pins layout keys (e.g. a
    published run's dp, tp, pp) and searches the rest."""
    out = []
    for layout in _candidates(world, cfg, hw.gpus_per_node, fixed or {}):
        par = dataclasses.replace(cfg.parallelism, **layout, virtual_stages=0)
        cluster = dataclasses.replace(cfg.cluster, gpus_per_node=hw.gpus_per_node)
        candidate = dataclasses.replace(cfg, parallelism=par, cluster=cluster)
        try:
            validate(candidate)
        except ConfigError:
            continue
        pred = predict(candidate, hw)
        need = pred["memory_bytes"]["total"]
        feasible = need <= hw.memory_bytes
        reason = "" if feasible else f"needs {need / GiB:.1f} GiB per rank > {hw.memory_bytes / GiB:.1f} GiB"
        out.append({**layout, "feasible": feasible, "reason": reason, **pred})
    out.sort(key=lambda r: (not r["feasible"], -r["predicted_tokens_per_s"], r["memory_bytes"]["total"]))
    return out


def describe(cfg: Config, hw: Hardware) -> str:
    """One line of the planner's view of a config's own layout (what jobs/ quote in a comment)."""
    pred = predict(cfg, hw)
    need = pred["memory_bytes"]["total"]
    fits = "fits" if need <= hw.memory_bytes else "DOES NOT FIT"
    return (
        f"{hw.name}, {cfg.parallelism.world_size} ranks: {need / GiB:.1f} GiB/rank of "
        f"{hw.memory_bytes / GiB:.1f} ({fits}), {pred['predicted_tokens_per_s']:,.0f} tokens/s, "
        f"MFU {pred['predicted_mfu']:.1%}, bubble {pred['bubble_fraction']:.1%}"
    )


def format_table(rows: list[dict]) -> str:
    """Planner rows as the fixed-width table ``plan`` prints."""
    lines = [
        f"{'dp':>4} {'tp':>3} {'pp':>3} {'schedule':>16} {'mb':>4} {'zero':>4} {'ac':>3} {'sp':>3} "
        f"{'GiB/rank':>9} {'tokens/s':>12} {'MFU':>6} {'bubble':>6}  note"
    ]
    for r in rows:
        lines.append(
            f"{r['dp']:>4} {r['tp']:>3} {r['pp']:>3} {r['schedule']:>16} {r['microbatches']:>4} {r['zero']:>4} "
            f"{'y' if r['activation_checkpointing'] else 'n':>3} {'y' if r['sequence_parallel'] else 'n':>3} "
            f"{r['memory_bytes']['total'] / GiB:>9.2f} "
            f"{r['predicted_tokens_per_s']:>12,.0f} {r['predicted_mfu']:>6.1%} {r['bubble_fraction']:>6.1%}  "
            f"{r['reason']}"
        )
    return "\n".join(lines)
