"""Cost model of one training step per rank: memory, compute, communication, bubble.

Sources of the formulas (cited where used):
- ZeRO memory: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models" (SC'20), section 3: mixed-precision Adam holds 2 + 2 + 12 bytes/param.
- Activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models" (MLSys'23), eqs. 1-4: s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit, divided by t
  under TP (+SP), 2*s*b*h with full recomputation.
- Pipeline bubble and in-flight micro-batches: Narayanan et al., "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM" (SC'21), sections 2.2 and 3.
- DualPipeV: DeepSeek-AI, "DeepSeek-V3 Technical Report" (2024), table 2, and the DualPipe
  repository's table for its V variant: bubble (PP/2-1)(F&B+B-3W), activations of PP+1 chunks,
  over PP = 2*pp chunks.
- Zero-bubble schedules: Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR'24): backward split
  into an input half (B) and a weight half (W) that fills the drain; ZB-H1's bubble is
  (p-1)(T_F + T_B - T_W) a stage, 1/v of it for v interleaved chunks (InterleavedZeroBubble), with
  the activations of 1F1B (p micro-batches); ZB-V (ZBVZeroBubble) the same from 2p micro-batches on.
- Breadth-first looping (LoopedBFS): Lamy-Poirier, "Breadth-First Pipeline Parallelism" (MLSys'23):
  every micro-batch's forward through a chunk before the next chunk, so the bubble of an interleaved
  schedule and the activations of all micro-batches (as GPipe).
- FLOPs per token: raytrain_hybrid.models.flops (6N + attention).
- Context parallelism by all-to-all head exchange: Jacobs et al., "DeepSpeed Ulysses" (2023):
  activations / cp, four all-to-alls a layer forward (q, k, v in; the output back) and four backward.
- Mixtures of experts (Fedus et al., "Switch Transformers", 2021; TorchTitan's and Megatron's
  expert parallelism): FLOPs of the active parameters (a token's top-k experts); every expert
  held in memory, 1/ep of them a rank under expert parallelism, whole on each TP rank; two
  all-to-alls (dispatch, combine) a MoE layer forward and two backward, each moving a
  micro-batch's tokens times top-k at model width, (ep-1)/ep of it to other ranks.
- Hybrid sharding (parallelism.replicate; Zhao et al., "PyTorch FSDP", VLDB'23, section 3.2.2, and
  TorchTitan's HSDP): the state sharded over the shard group only (dp/replicate x cp ranks), the
  gradients reduce-scattered inside it, then one all-reduce of the shard's gradients (1/shard of
  them) across the replicate ranks holding the same shard, over the network once dp x cp x tp
  workers leave a node.
"""

from __future__ import annotations

import math

from raytrain_hybrid.config import Config
from raytrain_hybrid.models import get_arch
from raytrain_hybrid.models.flops import attention_width, flops_per_token, tokens_per_row
from raytrain_hybrid.models.params import anchored_params, has_sequence_parallel, num_blocks, param_count, param_parts
from raytrain_hybrid.planner.hardware import Hardware


def max_rank_params(cfg: Config) -> float:
    """Parameters on the fullest pipeline rank, before TP/DP sharding (stages are uneven)."""
    from raytrain_hybrid.distributed.pipeline import split_layers, stage_ids

    par = cfg.parallelism
    copies = get_arch(cfg.model.arch).held_copies(cfg.model)  # a tied head's copy, on the last stage
    if par.pp == 1:
        return float(param_count(cfg.model) + copies)
    per_layer, first, last = param_parts(cfg.model)
    last += copies
    split = split_layers(num_blocks(cfg.model), par.num_stages)
    anchored = anchored_params(cfg.model)  # e.g. a second encoder's embeddings, with its first block
    best = 0.0
    for rank in range(par.pp):
        ids = stage_ids(par.schedule, rank, par.pp, par.stages_per_rank)
        n = sum(len(split[i]) * per_layer for i in ids)
        n += first if 0 in ids else 0
        n += last if par.num_stages - 1 in ids else 0
        n += sum(extra for block, extra in anchored.items() if any(block in split[i] for i in ids))
        best = max(best, n)
    return best


def expert_rank_params(cfg: Config, part: str = "expert_params") -> float:
    """Expert weights on the fullest pipeline rank (the most blocks), before ep sharding; ``part``
    "whole_params": the rest of the MoE blocks there, whole on each TP rank, not split over ep;
    "tp_whole_params": the modules the tensor-parallel plan leaves out there, whole on each TP rank."""
    from raytrain_hybrid.distributed.pipeline import split_layers, stage_ids

    per_block = getattr(get_arch(cfg.model.arch), part)(cfg.model)
    if not per_block:
        return 0.0
    par = cfg.parallelism
    if par.pp == 1:
        return float(per_block * num_blocks(cfg.model))
    split = split_layers(num_blocks(cfg.model), par.num_stages)
    ranks = (stage_ids(par.schedule, r, par.pp, par.stages_per_rank) for r in range(par.pp))
    return float(per_block * max(sum(len(split[i]) for i in ids) for ids in ranks))


def moe_flops_share(cfg: Config) -> float:
    """The share of a token's FLOPs in its mixture-of-experts blocks (the router, shared experts and
    its top-k experts: whole on each TP rank); 0 for a dense model."""
    m, spec = cfg.model, get_arch(cfg.model.arch)
    experts, rest = spec.expert_params(m), spec.whole_params(m)
    if not experts and not rest:
        return 0.0
    count, per_token = spec.experts(m)
    active = (rest + experts * per_token / max(count, 1)) * num_blocks(m)
    return min(1.0, 6.0 * active / flops_per_token(m))


def ep_alltoall_s(cfg: Config, micro_batch: int, hw: Hardware) -> float:
    """Expert parallelism's all-to-alls of a step on one rank: dispatch and combine forward and
    backward, each MoE layer and micro-batch; inside a node when ep*cp*tp workers fit one (an ep
    group is consecutive dp ranks)."""
    m, par = cfg.model, cfg.parallelism
    ep = par.ep
    if ep == 1:
        return 0.0
    width = 2.0 if cfg.train.dtype == "bfloat16" else 4.0
    per_token = get_arch(m.arch).experts(m)[1]
    pairs = micro_batch * (m.seq_len // par.cp) * per_token  # a cp rank routes its slice
    link = hw.intra_node_gbps if ep * par.cp * par.tp <= hw.gpus_per_node else hw.inter_node_gbps
    one = pairs * m.hidden_size * width * (ep - 1) / ep / (link * 1e9) + (ep - 1) * hw.latency_s
    return 4 * one * (num_blocks(m) / par.pp) * par.microbatches


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


def lora_state_bytes(cfg: Config, phi: float, *, zero: int, dp: int) -> tuple[dict[str, float], float]:
    """LoRA (lora.rank > 0): the frozen base's phi parameters (this rank's share) hold their
    weights alone, in bf16 with train.dtype=bfloat16, else fp32, sharded over dp by FSDP
    (zero=3); no gradient, no optimizer state. The adapters on this rank's blocks (after TP)
    hold what full training holds (state_bytes). Returns (bytes, adapter parameters)."""
    from raytrain_hybrid.models.lora import adapter_params

    par = cfg.parallelism
    per_block, blocks = adapter_params(cfg)
    adapters = per_block * math.ceil(blocks / par.pp) / par.tp
    width = 2.0 if cfg.train.dtype == "bfloat16" else 4.0
    states = state_bytes(adapters, zero=zero, dp=dp)
    states["params"] += width * phi / (dp if zero >= 3 else 1)
    return states, adapters


def in_flight_microbatches(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """Micro-batches whose activations the first stage holds at its peak (Narayanan et al. 2021),
    in units of the rank's layers."""
    if pp == 1:
        return 1.0
    if schedule in ("GPipe", "LoopedBFS"):  # every forward before the backwards begin
        return float(microbatches)
    if schedule == "DualPipeV":  # 2*pp+1 chunks of half a rank's layers, on every rank
        return pp + 0.5
    if schedule == "ZBVZeroBubble":  # one chunk-forward more in flight every second micro-batch, up to pp
        return min(float(pp), (microbatches + 1) / 2)
    if schedule == "InterleavedZeroBubble":  # ZB-H1 keeps 1F1B's pp micro-batches
        return float(min(microbatches, pp))
    base = float(min(microbatches, pp))
    return base * (1 + (pp - 1) / (pp * virtual)) if virtual > 1 else base


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """Idle share of a rank's step: pp-1 stage slots of fill and drain against microbatches x
    virtual of work (Narayanan et al. 2021). DualPipeV splits backward into input and weight halves
    and fills the ramps with weight halves: with forward, input and weight halves alike per chunk
    (F = B = W) and F&B unoverlapped (3F), (pp-1) F idle against 6 F a micro-batch. The zero-bubble
    schedules fill the drain with weight halves too (zero_bubble_idle)."""
    if pp == 1:
        return 0.0
    if schedule == "DualPipeV":
        return (pp - 1) / (6 * microbatches + pp - 1)
    if schedule in ZERO_BUBBLE:  # idle chunk-forwards of the fill against 3 m units (F + B + W) a rank
        idle = zero_bubble_idle(schedule, pp, microbatches, virtual)
        return idle / (3 * microbatches + idle)
    return (pp - 1) / (microbatches * virtual + pp - 1)


ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble")


def zero_bubble_idle(schedule: str, pp: int, microbatches: int, virtual: int) -> float:
    """A rank's idle time in a step of a zero-bubble schedule, in units of one stage's forward (F = B
    = W): ZB-H1's (pp-1)(F + B - W) over v chunks (Qi et al. 2024); ZB-V's V layout reaches that at
    2*pp micro-batches and idles 2*pp-1-m below it (torch's ZBV order, timed)."""
    if schedule == "ZBVZeroBubble":
        return max(2 * pp - 1 - microbatches, (pp - 1) / 2)
    return (pp - 1) / virtual


def layer_activation_bytes(
    s: int, b: int, h: int, t: int, *, sp: bool, checkpointed: bool, heads: float = 1.0
) -> float:
    """16-bit activation bytes one transformer layer keeps for backward (Korthikanti et al.
    2022, eqs. 2-5). The attention-score term 5*a*s/h of the paper is left out: sdpa's flash /
    memory-efficient kernels recompute scores in backward instead of storing them (the paper's
    "selective recomputation" gets the same). TP without SP: 10 + 24/t per s*b*h (norms,
    dropout masks and the residual stream stay whole on every TP rank); with SP: 34/t;
    full recomputation keeps only each layer's input, 2*s*b*h (/t with SP). ``heads``: the
    queries' width (heads x head width) over h; q, k, v and the attention output (8 of the 24
    TP-sharded s*b*h) take that width, not h."""
    if checkpointed:
        return 2.0 * s * b * h / (t if sp else 1)
    sharded = 24.0 + 8.0 * (heads - 1.0)
    return s * b * h * ((10.0 + sharded) / t if sp else 10.0 + sharded / t)


def activation_bytes(cfg: Config, micro_batch: int) -> float:
    m, par = cfg.model, cfg.parallelism
    # Under context parallelism a rank keeps the activations of its 1/cp of the sequence.
    s, b, h, t = m.seq_len // par.cp, micro_batch, m.hidden_size, par.tp
    sp = t > 1 and par.sequence_parallel and has_sequence_parallel(m)
    width = 2.0 if cfg.train.dtype == "bfloat16" else 4.0  # the formula counts 2-byte activations
    # "selective" keeps every matmul and attention output and recomputes only element-wise ops:
    # counted as no checkpointing (an upper bound on its memory, no extra forward FLOPs).
    full = par.activation_checkpointing is True
    heads = attention_width(m) / h
    per_layer = layer_activation_bytes(s, b, h, t, sp=sp, checkpointed=full, heads=heads)
    layers_per_rank = num_blocks(m) / par.pp
    in_flight = in_flight_microbatches(par.schedule, par.pp, par.microbatches, par.stages_per_rank if par.pp > 1 else 1)
    stash = per_layer * (width / 2) * layers_per_rank * in_flight
    if full:  # the layer being recomputed holds its full activations
        stash += layer_activation_bytes(s, b, h, t, sp=sp, checkpointed=False, heads=heads) * (width / 2)
    # fp32 logits and their gradient, gathered on the last stage.
    logits = 2 * 4.0 * b * get_arch(m.arch).logits_per_row(m) / par.cp
    return stash + logits + packing_mask_bytes(cfg, b, layers_per_rank, in_flight)


def packing_mask_bytes(cfg: Config, micro_batch: int, layers: float, in_flight: float) -> float:
    """data.packing: the dense document mask attention reads, [rows, 1, seq, seq] over the whole
    sequence (under cp too: the all-to-all attention spans it). One boolean copy per micro-batch
    in flight (the blocks keep it for backward), and the additive bias SDPA turns it into, in the
    activation dtype, per layer that keeps its attention inputs (one at a time under full
    recomputation). Quadratic in seq_len: 12 GiB a row at 65,536 tokens in bf16."""
    if not cfg.data.packing:
        return 0.0
    square = micro_batch * float(cfg.model.seq_len) ** 2
    width = 2.0 if cfg.train.dtype == "bfloat16" else 4.0
    biases = 1.0 if cfg.parallelism.activation_checkpointing is True else layers * in_flight
    return square * (in_flight + width * biases)


def _allreduce_s(nbytes: float, n: int, gbps: float, latency: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / (gbps * 1e9) + 2 * (n - 1) * latency


def cp_alltoall_s(cfg: Config, micro_batch: int, hw: Hardware) -> float:
    """Seconds of a step's context-parallel all-to-alls on one rank: per layer and micro-batch q,
    k, v (key/value heads repeated as distributed.context_parallel does) and the output, forward
    and backward; each moves (cp-1)/cp of its tensor, inside a node when cp*tp workers fit one."""
    m, par = cfg.model, cfg.parallelism
    cp, tp = par.cp, par.tp
    if cp == 1:
        return 0.0
    width = 2.0 if cfg.train.dtype == "bfloat16" else 4.0
    q_bytes = micro_batch * (m.seq_len // cp) * (attention_width(m) // tp) * width
    kv_local = max(1, m.num_kv_heads // tp)
    kv_heads = kv_local * cp // math.gcd(kv_local, cp)
    kv_bytes = q_bytes * min(1.0, kv_heads / max(1, m.num_heads // tp))
    link = hw.intra_node_gbps if cp * tp <= hw.gpus_per_node else hw.inter_node_gbps
    one_way = (2 * q_bytes + 2 * kv_bytes) * (cp - 1) / cp / (link * 1e9) + 4 * (cp - 1) * hw.latency_s
    return 2 * one_way * (num_blocks(m) / par.pp) * par.microbatches


def predict(cfg: Config, hw: Hardware) -> dict:
    """Per-rank memory, step time, tokens/s, MFU and bubble of one layout."""
    m, par, t = cfg.model, cfg.parallelism, cfg.train
    dp, tp, pp, mb, cp = par.dp, par.tp, par.pp, par.microbatches, par.cp
    virtual = par.stages_per_rank if pp > 1 else 1
    micro_batch = t.global_batch_size // (dp * mb)
    # Experts are whole on each TP rank and 1/ep a rank under expert parallelism; a generic family's
    # router and shared experts whole on each TP rank too.
    # And a generic family's modules that its tensor-parallel plan leaves out (MiniMax's linear attention).
    ep, experts = par.ep, expert_rank_params(cfg)
    whole = expert_rank_params(cfg, "whole_params") + (expert_rank_params(cfg, "tp_whole_params") if tp > 1 else 0)
    phi = (max_rank_params(cfg) - experts - whole) / tp + whole + experts / ep
    # The cp ranks of a replica average gradients like replicas: ZeRO shards over dp x cp (over the
    # shard group, dp/replicate x cp, under hybrid sharding); the experts' state over the dp/ep ranks
    # holding the same experts.
    shard = dp // par.replicate
    states = state_bytes(phi - experts / ep, zero=par.zero, dp=shard * cp)
    if experts:
        # (the dp/ep x cp ranks holding the same experts: distributed.expert_parallel.ep_mesh)
        expert_states = state_bytes(experts / ep, zero=par.zero, dp=dp // ep * cp)
        states = {k: v + expert_states[k] for k, v in states.items()}
    trained = phi  # parameters with gradients, optimizer state and a DP reduction
    if cfg.lora.rank:  # the frozen base holds its weights only; the adapters train
        states, trained = lora_state_bytes(cfg, phi, zero=par.zero, dp=shard * cp)
    act = activation_bytes(cfg, micro_batch)
    memory = {**states, "activations": act}
    memory["total"] = sum(memory.values())

    tokens = t.global_batch_size * tokens_per_row(m)
    # A mixture of experts runs whole on every TP rank, as do modules the plan leaves out: their share
    # of the FLOPs is not divided by tp.
    whole, spec = moe_flops_share(cfg), get_arch(m.arch)
    unsplit = whole
    if tp > 1:  # (at tp=1 nothing is split: a family's count is not asked for, which may build its model)
        unsplit = min(1.0, whole + 6.0 * spec.tp_whole_params(m) * num_blocks(m) / flops_per_token(m))
    flops = flops_per_token(m) * tokens / (dp * cp * pp) * ((1 - unsplit) / tp + unsplit)
    if par.activation_checkpointing is True:  # (selective recomputes element-wise ops only)
        flops *= 4 / 3  # one more forward
    compute = flops / (hw.peak_tflops * 1e12 * hw.efficiency)
    world = dp * cp * tp * pp
    # More ranks than cores: each rank gets cores/world of a core, and a rank idle in a
    # pipeline bubble hands its core to another, so the bubble costs no time.
    oversubscribed = bool(hw.cores) and world > hw.cores
    share = world / hw.cores if oversubscribed else 1.0
    compute *= share

    width = 2.0 if t.dtype == "bfloat16" else 4.0
    act_msg = micro_batch * (m.seq_len // cp) * m.hidden_size * width
    layers_per_rank = num_blocks(m) / pp
    # TP: two all-reduces forward and two backward per block and micro-batch, inside a node (under
    # sequence parallelism an all-gather and a reduce-scatter each, as many bytes): attention's and
    # the MLP's. A mixture of experts runs whole on every TP rank instead: no collective of its own,
    # or under sequence parallelism its input's all-gather forward and that one's reduce-scatter
    # backward (its output is sliced back to the shards without one). Likewise an attention the plan
    # leaves whole (Youtu's; MiniMax's linear-attention layers), in that share of the blocks.
    sp = par.sequence_parallel and has_sequence_parallel(m)
    split_attention = 1.0 - (spec.tp_whole_attention(m) if tp > 1 else 0.0)
    split_mlp = 0.0 if whole else 1.0 - (spec.tp_whole_mlp(m) if tp > 1 else 0.0)
    # (a split module: an all-reduce each way; a whole one: under SP its input's all-gather and back)
    reduces = sum(2 * split + (1 if sp else 0) * (1 - split) for split in (split_attention, split_mlp))
    tp_s = reduces * layers_per_rank * mb * _allreduce_s(act_msg, tp, hw.intra_node_gbps, hw.latency_s)
    if tp > 1:  # attention and a dense MLP are one column/row pair each
        tp_s += (split_attention + split_mlp) * layers_per_rank * mb * hw.tp_pair_overhead_s * (tp / 2) * share
    cp_s = cp_alltoall_s(cfg, micro_batch, hw) * share
    ep_s = ep_alltoall_s(cfg, micro_batch, hw) * share
    # Placement fills nodes TP-first, then CP, then DP, then PP: an axis leaves the node once the
    # product of the axes inside it exceeds the node.
    dp_link = hw.intra_node_gbps if tp * cp * shard <= hw.gpus_per_node else hw.inter_node_gbps
    replica_link = hw.intra_node_gbps if tp * cp * dp <= hw.gpus_per_node else hw.inter_node_gbps
    pp_link = hw.intra_node_gbps if tp * cp * dp * pp <= hw.gpus_per_node else hw.inter_node_gbps
    pp_s = 0.0 if pp == 1 else 2 * mb * virtual * (act_msg / (pp_link * 1e9) + hw.latency_s)
    grad_bytes = (trained - experts / ep) * 4.0
    dp_s = _allreduce_s(grad_bytes, shard * cp, dp_link, hw.latency_s) * (1.5 if par.zero == 3 else 1.0)
    # Hybrid sharding: the shard's gradients all-reduced across the replica groups.
    replicate_s = _allreduce_s(grad_bytes / (shard * cp), par.replicate, replica_link, hw.latency_s)
    dp_s += replicate_s
    if experts and dp // ep > 1:  # the experts' gradients over the ranks holding the same experts
        dp_s += _allreduce_s(experts / ep * 4.0, dp // ep, dp_link, hw.latency_s) * (1.5 if par.zero == 3 else 1.0)
    # Buckets overlap with the backward (2/3 of compute) on devices; on shared cores the
    # reduction takes CPU from the same cores and does not hide.
    dp_exposed = dp_s * share if oversubscribed else max(0.0, dp_s - 0.5 * compute)

    bubble = bubble_fraction(par.schedule, pp, mb, virtual)
    step = (compute + tp_s + cp_s + ep_s + pp_s) / (1 if oversubscribed else 1 - bubble) + dp_exposed
    tokens_per_s = tokens / step
    achieved = flops_per_token(m) * tokens_per_s / world / 1e12
    return {
        "memory_bytes": memory,
        "predicted_step_s": step,
        "predicted_tokens_per_s": tokens_per_s,
        "predicted_mfu": achieved / hw.peak_tflops,
        "bubble_fraction": bubble,
        "time_s": {
            "compute": compute,
            "tp": tp_s,
            "cp": cp_s,
            "ep": ep_s,
            "pp": pp_s,
            "dp": dp_s,
            "dp_replicate": replicate_s,  # (part of dp)
            "dp_exposed": dp_exposed,
        },
    }
