"""Expert parallelism (``parallelism.ep``): a mixture of experts' experts sharded over ep ranks
carved from the data-parallel ones, as TorchTitan and Megatron-LM do.

The ep ranks of a group are ``ep`` consecutive data-parallel replicas (same pipeline stage, same
cp and tp rank: under context parallelism each cp rank routes its slice of the sequences). Each
holds ``num_experts / ep`` experts: the 3D expert weights become DTensors sharded along the
expert dimension over the ep mesh, so a checkpoint, the init rule and the gradient norm see the
whole tensors under their transformers names. In forward each rank routes its own tokens (the
router stays replicated), sends every token-expert pair to the rank holding that expert with one
``all_to_all_single`` (after one exchanging the counts), computes its experts on what it
received (torch._grouped_mm on Hopper in bf16, a loop over local experts elsewhere), and sends
the results back with a second all-to-all; autograd runs the same exchanges backwards.
Dispatch is dropless: every pair is computed, however uneven the routing.

Gradients: an expert's gradient on its rank already sums the contributions of the ep group's
tokens, so the expert weights are averaged over the dp/ep x cp ranks holding the same experts
(their own FSDP2 unit on that mesh, gradients divided by dp x cp; under ZeRO-1 their own ZeRO-1
slices on that group, data_parallel.py), the other weights over dp (x cp) as before.
This is a module transformation: the transformers model code is unchanged.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Shard

from raytrain_hybrid.models.spec import ArchSpec

EP_DIMS = ("pp", "erep", "eshard", "ep", "cp", "tp")


def ep_mesh(world, dims):
    """The world's ranks as (pp, erep, eshard, ep, cp, tp): an ep group is ``ep`` consecutive
    dp replicas; the dp/ep x cp ranks holding the same experts are erep (ZeRO-0 replicas, ZeRO-1
    slices) or eshard (ZeRO-2/3: FSDP shards), the cp ranks folded into them (cp is size 1 here).
    Built once per world mesh (its process groups are created by every rank together, on the
    first stage each builds; kept on the world mesh, no module state)."""
    if getattr(world, "_expert_mesh", None) is None:
        from torch.distributed.device_mesh import DeviceMesh

        pp, cp, tp, ep = dims.pp, dims.cp, dims.tp, dims.ep
        # The cp ranks of a replica hold the same experts (each routes its slice of the sequences
        # to its own ep group): they join the dp/ep ranks holding them, gradients reduced over all.
        held = dims.dp // ep * cp
        ranks = world.mesh.reshape(pp, dims.dp // ep, ep, cp, tp).transpose(2, 3).reshape(pp, held, ep, tp)
        shape = (pp, held, 1, ep, 1, tp) if dims.zero in (0, 1) else (pp, 1, held, ep, 1, tp)
        world._expert_mesh = DeviceMesh(world.device_type, ranks.reshape(shape), mesh_dim_names=EP_DIMS)
    return world._expert_mesh


def _experts(stage, spec: ArchSpec):
    path = spec.moe["experts"]
    return [m for name, m in stage.named_modules() if name.endswith("." + path)]


def refusal(experts) -> str | None:
    """Why ``experts`` is not a module the dispatch below runs (None: it is): transformers' stacked
    experts (``num_experts``, ``act_fn``, ``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F]
    without biases, forward(hidden states, expert indices, routing weights)), as Qwen-MoE's, Mixtral's
    and most of transformers' mixtures of experts are."""
    import inspect

    gate_up, down, count = (getattr(experts, n, None) for n in ("gate_up_proj", "down_proj", "num_experts"))
    if not isinstance(count, int) or gate_up is None or down is None or not hasattr(experts, "act_fn"):
        return "has an experts module that is not transformers' stacked experts (gate_up_proj, down_proj, act_fn)"
    shapes = f"gate_up_proj {list(gate_up.shape)}, down_proj {list(down.shape)}"
    if gate_up.dim() != 3 or down.dim() != 3 or (gate_up.shape[0], down.shape[0]) != (count, count):
        return f"stores its experts otherwise ({shapes}; expert parallelism takes [E, 2F, H] and [E, H, F])"
    if (
        gate_up.shape[1] != 2 * down.shape[2]
        or gate_up.shape[2] != down.shape[1]
        or getattr(experts, "is_transposed", 0)
    ):
        return f"stores its experts otherwise ({shapes}; expert parallelism takes [E, 2F, H] and [E, H, F])"
    if getattr(experts, "is_concatenated", True) is False:  # (gate and up interleaved, not two halves)
        return "stores its experts' gate and up projections interleaved, which the dispatch does not split"
    if getattr(experts, "has_bias", False) or any(n.endswith("bias") for n, _ in experts.named_parameters()):
        return "has experts with biases, which the expert-parallel dispatch does not add"
    if len(inspect.signature(type(experts).forward).parameters) != 4:  # (self, hidden, indices, weights)
        return "has experts whose forward is not (hidden states, expert indices, routing weights)"
    return None


def apply_ep(stage, spec: ArchSpec, mesh, dims) -> None:
    """On the meta device, before FSDP: shard every experts module of ``stage`` over the ep mesh
    and route its forward through the all-to-all dispatch."""
    group_mesh = ep_mesh(mesh.world, dims)["ep"]
    for experts in _experts(stage, spec):
        if (why := refusal(experts)) is not None:  # (a registered model's: the matrix holds transformers')
            raise ValueError(f"parallelism.ep={dims.ep}: the model {why}; use parallelism.ep=1")
        total = experts.num_experts
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            local = full.new_empty((total // dims.ep, *full.shape[1:]))
            shard = DTensor.from_local(
                local, group_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
            )
            setattr(experts, name, torch.nn.Parameter(shard))
        experts.ep_group = group_mesh.get_group()
        experts.total_experts = total
        # Eager under parallelism.compile: the all-to-alls' splits are this step's routing (data-
        # dependent sizes a graph would specialise on and recompile for); the block compiles around it.
        experts.forward = torch._dynamo.disable(types.MethodType(_ep_forward, experts))


def shard_experts(stage, spec: ArchSpec, mesh, dims, **fsdp) -> None:
    """FSDP2 over the ranks holding the same experts (before the blocks are wrapped over dp): the
    expert weights' gradients summed over them and divided by dp (see the module docstring)."""
    from torch.distributed.fsdp import fully_shard

    em = ep_mesh(mesh.world, dims)
    for experts in _experts(stage, spec):
        fully_shard(experts, mesh=em["erep", "eshard"], **fsdp)
        experts.set_gradient_divide_factor(float(dims.dp * dims.cp))  # the loss's average over dp x cp
        # gloo has no PREMUL_SUM, which a reduce-scatter over several ranks takes for a factor other
        # than their count (ZeRO-2/3 under ep with dp/ep x cp > 1): sum, then divide.
        if em.device_type != "cuda" and em["eshard"].size() > 1:
            experts.set_force_sum_reduction_for_comms(True)


def is_expert(p) -> bool:
    """Whether ``p`` is an expert weight sharded over the ep mesh (by apply_ep)."""
    return isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("ep",)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _grouped(x: torch.Tensor) -> bool:
    """torch._grouped_mm for the experts: a Hopper (or newer) GPU, in bf16 (autocast or bf16 data)."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm")) or torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    return x.dtype == torch.bfloat16 or torch.is_autocast_enabled("cuda")


def _gate(experts, gate_up_out: torch.Tensor) -> torch.Tensor:
    """The experts' own gating of the gate/up projection's output where their class has one
    (transformers' ``_apply_gate``: Beam's computes the activation in fp32), else act(gate) * up."""
    if hasattr(experts, "_apply_gate"):
        return experts._apply_gate(gate_up_out)
    gate, up = gate_up_out.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def _compute(experts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The local experts on their rows of ``x`` (grouped by expert, ``counts`` rows each)."""
    gate_up, down = _local(experts.gate_up_proj), _local(experts.down_proj)
    if _grouped(x):  # one kernel for all local experts; autocast does not reach it: bf16 by hand
        bf16 = torch.bfloat16
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        gate_up_out = torch._grouped_mm(x.to(bf16), gate_up.to(bf16).transpose(-2, -1), offs=offs)
        return torch._grouped_mm(_gate(experts, gate_up_out).to(bf16), down.to(bf16).transpose(-2, -1), offs=offs)
    outs = []
    for e, rows in enumerate(x.split(counts)):
        outs.append(torch.nn.functional.linear(_gate(experts, torch.nn.functional.linear(rows, gate_up[e])), down[e]))
    return torch.cat(outs) if outs else x[:0]


def _ep_forward(experts, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """transformers' experts forward (hidden [T, H], indices and weights [T, k]) over the ep group."""
    group = experts.ep_group
    ep, total = dist.get_world_size(group), experts.total_experts
    local = total // ep
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # token-expert pairs grouped by expert, so by rank
    counts = torch.bincount(flat, minlength=total)
    # Pairs each source sends for each of this rank's experts: [ep sources, local experts].
    received = funcol.all_to_all_single(counts, None, None, group).wait().view(ep, local)
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_splits = received.sum(1).tolist()
    x = funcol.all_to_all_single_autograd(hidden[order // k], recv_splits, send_splits, group)
    # Received rows come by source, then by expert: regroup them by expert for the compute.
    expert_of_row = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(received.reshape(-1))
    by_expert = torch.argsort(expert_of_row, stable=True)
    out = _compute(experts, x[by_expert], received.sum(0).tolist())  # (bf16 from the grouped kernel)
    y = torch.empty_like(out).index_copy(0, by_expert, out)
    experts.computed = x.shape[0]  # token-expert pairs computed here (dropped_tokens: routed - computed)
    back = funcol.all_to_all_single_autograd(y, send_splits, recv_splits, group)
    pairs = torch.empty_like(back).index_copy(0, order, back)  # back in (token, k) order
    weighted = pairs * top_k_weights.reshape(-1, 1).to(pairs.dtype)
    return weighted.view(-1, k, hidden.shape[-1]).sum(1).to(hidden.dtype)
