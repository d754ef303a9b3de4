"""The step's losses and learning-rate schedule, the same for every layout."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from raytrain_hybrid.config import Config
from raytrain_hybrid.data.corpus import IGNORE_INDEX


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to the peak, then cosine decay to ``min_ratio`` of it at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class TokenLoss:
    """Next-token cross-entropy of one micro-batch (labels already shifted): the sum over its
    counted labels (IGNORE_INDEX ones are not) times ``scale``, which ``start_step`` sets to
    microbatches * dp / (counted labels of the whole global batch).

    Why not each micro-batch's mean: with label masks (chat, prompt/completion data) micro-batches
    and replicas count different numbers of tokens, and the mean of their means weighs a token
    of a short answer more than one of a long answer, differently for every split into
    micro-batches and replicas. The pipeline schedule divides the gradients by the micro-batch
    count (scale_grads) and DDP/FSDP/ZeRO-1 average them over dp; with this scale what remains
    is sum(cross-entropy of every counted token of the step) / their count, whatever the layout.
    Without masks every micro-batch counts rows*seq_len labels and this is its mean, as before.
    Under context parallelism each cp rank sums the tokens of its slice and gradients are
    averaged over dp x cp: the trainer passes dp*cp as ``dp``, and the sum is again the step's.
    """

    def __init__(self) -> None:
        self.scale = 1.0

    def start_step(self, counted: int, microbatches: int, dp: int) -> None:
        self.scale = microbatches * dp / max(counted, 1)  # a step with nothing counted moves nothing

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = logits.flatten(0, 1).float()
        return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum") * self.scale


class ClassLoss:
    """sum(weight[label] * cross-entropy) / rows of one micro-batch.

    Not F.cross_entropy(weight=...): that divides by the micro-batch's sum of weights,
    which depends on how the batch is cut into micro-batches and replicas, so layouts
    would train different models. Dividing by the row count keeps the mean over
    micro-batches and replicas equal to the global batch's.
    """

    def __init__(self, weights: list[float], classes: int, device: torch.device) -> None:
        self.weights = torch.tensor(weights or [1.0] * classes, dtype=torch.float32, device=device)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        per_row = F.cross_entropy(logits.float(), labels, reduction="none")
        return (self.weights[labels] * per_row).mean()


def make_loss(cfg: Config, task: str, device: torch.device):
    if task == "lm":
        return TokenLoss()
    return ClassLoss(cfg.model.class_weights, cfg.model.num_classes, device)


class _WithAuxGrad(torch.autograd.Function):
    """The routing weights unchanged; in backward, also the auxiliary loss's gradient (``scale``
    d(aux)): the language-model loss's backward reaches every router through its block's output,
    so the auxiliary loss needs no path of its own through the pipeline (Megatron's
    MoEAuxLossAutoScaler does the same)."""

    @staticmethod
    def forward(ctx, weights, aux, scale: float):
        ctx.scale = scale
        return weights.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full((), ctx.scale), None


class RouterLoss:
    """The routers' load-balancing loss and the step's expert load, by forward hooks on each
    block's router and experts (the spec's ``moe``); model code is unchanged.

    The loss of one sequence and one MoE layer is transformers' load_balancing_loss_func on that
    layer's router logits for that sequence: E * sum_e f_e * P_e, f_e the fraction of the
    sequence's top-k assignments to expert e and P_e its mean router probability. The step's
    auxiliary loss is router_aux_loss_coef times their mean over the global batch's sequences
    and the model's MoE layers. transformers takes f and P over all layers and the whole batch
    at once, which no pipeline stage or micro-batch sees before its backward; per sequence and
    layer, every term is known where it is computed, so every layout trains the same model
    (for one sequence and one MoE layer the two definitions agree)."""

    def __init__(
        self, modules, moe: dict, *, experts: int, moe_layers: int, seq_len: int, coef: float, cp_group=None, top_k=0
    ):
        self.experts, self.moe_layers, self.seq_len, self.coef = experts, moe_layers, seq_len, coef
        # A generic family's router (models.generic_router: "logits", its output's index of them) is
        # hooked for its logits alone, as transformers' load_balancing_loss_func reads them: the top-k
        # taken from their softmax, the loss's gradient carried by its MoE block's output ("block").
        self.logits, self.top_k, self._pending = moe.get("logits"), top_k, None
        # Context parallelism: this rank routes a contiguous 1/cp of each sequence. A sequence's
        # term is e * sum_e f_e * P_e, with f the routed fractions over the whole sequence (its cp
        # ranks' counts summed, no gradient) and P the mean probabilities, linear in each token's:
        # each cp rank adds its tokens' share of P, and the shares sum to the term.
        self.cp_group = cp_group
        self.cp = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)
        self.scale = 0.0  # d(step loss)/d(one term), for this layout (start_step)
        self.unit = 0.0  # the weight of one term in the step's loss
        self.microbatches = 1
        # Per router (or experts module), what each of its forwards recorded this step.
        self._record: dict[int, list[torch.Tensor]] = {}
        self._computed: dict[int, list[torch.Tensor]] = {}
        self.device = next(p for m in modules for p in m.parameters()).device
        # The hooks keep Python state per step (and read the dispatch's token counts): run outside
        # torch.compile's graphs (a graph break each), not traced into guards that fail every step.
        router_hook = self._router_hook if self.logits is None else self._logits_hook
        router_hook, experts_hook = torch._dynamo.disable(router_hook), torch._dynamo.disable(self._experts_hook)
        block_hook = torch._dynamo.disable(self._block_hook)
        self.watch_experts = "experts" in moe
        for module in modules:
            for name, sub in module.named_modules():
                if name.endswith("." + moe["router"]):
                    sub.register_forward_hook(router_hook)
                    if self.logits is not None:  # (the block holding this router: under any wrapper)
                        block = name.removesuffix(moe["router"]) + moe["block"]
                        module.get_submodule(block).register_forward_hook(block_hook)
                elif self.watch_experts and name.endswith("." + moe["experts"]):
                    sub.register_forward_hook(experts_hook)

    def start_step(self, global_batch: int, dp: int, microbatches: int, scaled_by_schedule: bool) -> None:
        """Before a step: the pipeline schedule divides gradients by the micro-batch count
        afterwards (scale_grads), the loop without one divides each micro-batch's loss; data
        parallelism averages over dp. What is left is ``coef / (layers * global batch)`` a term."""
        self.unit = self.coef / (self.moe_layers * global_batch)
        self.scale = self.unit * dp * (microbatches if scaled_by_schedule else 1)
        self.microbatches = microbatches
        self._record, self._computed = {}, {}

    @staticmethod
    def _recording(t: torch.Tensor) -> bool:
        # Forward of a training step only: not evaluation, not a pipeline stage's shape
        # inference on meta tensors, not activation checkpointing's recomputation in backward.
        return torch.is_grad_enabled() and not t.is_meta and torch._C._current_graph_task_id() == -1

    def _router_hook(self, router, args, output):
        logits, weights, indices = output
        if not torch.is_grad_enabled() or logits.is_meta:
            return None
        aux = self._term(router, logits, indices)
        return logits, _WithAuxGrad.apply(weights, aux, self.scale), indices

    def _logits_hook(self, router, args, output):
        logits = output[self.logits] if isinstance(output, (tuple, list)) else output
        if not torch.is_grad_enabled() or logits.is_meta:
            return None
        with torch.no_grad():
            chosen = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1).indices
        # The experts the router chose, for expert_load, where its output holds them (its last integer
        # tensor): a family that routes otherwise than by the softmax's top-k (a sigmoid, a bias) too.
        routed = (
            [o for o in output if torch.is_tensor(o) and not o.is_floating_point()] if isinstance(output, tuple) else []
        )
        load = routed[-1] if routed and routed[-1].shape == chosen.shape else chosen
        self._pending = self._term(router, logits, chosen, load)  # (its block's output carries it: _block_hook)
        return None

    def _block_hook(self, block, args, output):
        aux, self._pending = self._pending, None
        if aux is None:  # (a pipeline stage's shape inference on meta tensors, evaluation)
            return None
        if isinstance(output, tuple):
            return (_WithAuxGrad.apply(output[0], aux, self.scale), *output[1:])
        return _WithAuxGrad.apply(output, aux, self.scale)

    def _term(self, router, logits: torch.Tensor, indices: torch.Tensor, load=None) -> torch.Tensor:
        """The loss's terms of the sequences a router saw (their sum, with its graph), recorded with
        the experts ``load`` names (default: ``indices``, the loss's choice)."""
        # Activation checkpointing's recomputation computes the same (it must save what the
        # forward saved) and records nothing.
        e, k, here = self.experts, indices.shape[-1], self.seq_len // self.cp
        probs = torch.softmax(logits.float(), dim=-1).view(-1, here, e)  # [sequences, tokens here, E]
        with torch.no_grad():
            hits = F.one_hot(indices.reshape(-1, here * k), e).sum(1).float()  # [sequences, E]
            whole = hits.clone()
            if self.cp_group is not None:
                torch.distributed.all_reduce(whole, group=self.cp_group)
        # load_balancing_loss_func of each sequence (this rank's share of it under cp)
        per_seq = e * (whole / self.seq_len * probs.mean(1) / self.cp).sum(-1)
        aux = per_seq.sum()
        if self._recording(logits):
            same = load is None or load is indices  # (the router's own choice: counted once)
            counted = hits if same else F.one_hot(load.reshape(-1, here * k), e).sum(1).float()
            self._record.setdefault(id(router), []).append(
                torch.cat([(aux.detach() * self.unit).reshape(1), counted.sum(0)])
            )
        return aux

    def _experts_hook(self, experts, args, output):
        """Token-expert pairs the experts computed: what expert parallelism's dispatch says it
        computed on this rank, or the routed pairs of a real expert (an index below E)."""
        if not self._recording(output):
            return
        computed = getattr(experts, "computed", None)
        if computed is None:
            computed = (args[1] < self.experts).sum()
        computed = torch.as_tensor(computed, dtype=torch.float32, device=self.device).reshape(1)
        self._computed.setdefault(id(experts), []).append(computed)

    def reduce(self, copies: int) -> dict:
        """After the step's backward, over the world (``copies``: ranks computing the same, tp):
        the auxiliary loss ("aux", a tensor), tokens routed to each expert over all MoE layers and
        the global batch ("expert_load"), and routed token-expert pairs no expert computed
        ("dropped_tokens", 0 when dropless)."""
        import torch.distributed as dist

        total = torch.zeros(2 + self.experts, device=self.device)
        # A module's last forwards, one a micro-batch: on the first step a pipeline stage runs one
        # before them to infer its shapes (torch.distributed.pipelining's metadata inference).
        for records in self._record.values():
            total[:-1] += torch.stack(records[-self.microbatches :]).sum(0)
        for computed in self._computed.values():
            total[-1] += torch.cat(computed[-self.microbatches :]).sum()
        total /= copies
        if dist.is_initialized():
            dist.all_reduce(total)
        load = total[1:-1].round()
        out = {"aux": total[0], "expert_load": load}
        if self.watch_experts:  # (what the experts computed is known where they are hooked)
            out["dropped_tokens"] = load.sum() - total[-1].round()
        return out


def make_router_loss(cfg: Config, spec, hf_config, modules, cp_group=None) -> RouterLoss | None:
    """The RouterLoss of a mixture-of-experts model's stages; None for a dense model, or a generic
    family without a router auxiliary loss (models.generic_router) or with a weight of 0 for it."""
    if spec.moe is None or "router" not in spec.moe:
        return None
    if "logits" in spec.moe:
        return _generic_router_loss(cfg, spec, hf_config, modules, cp_group)
    coef = cfg.model.router_aux_loss_coef
    layers = hf_config.num_hidden_layers
    sparse_step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % sparse_step == 0)
    experts = getattr(hf_config, "num_local_experts", None) or hf_config.num_experts
    seq = cfg.model.seq_len
    return RouterLoss(
        modules, spec.moe, experts=experts, moe_layers=moe_layers, seq_len=seq, coef=coef, cp_group=cp_group
    )


def _generic_router_loss(cfg: Config, spec, hf_config, modules, cp_group) -> RouterLoss | None:
    from raytrain_hybrid.models.generic_router import default_coef

    coef = cfg.model.router_aux_loss_coef
    if coef == type(cfg.model)().router_aux_loss_coef:  # left at its default: the checkpoint's own
        coef = default_coef(hf_config)
    if not coef:
        return None
    experts, top_k = spec.experts(cfg.model)
    # The MoE layers of the whole model (a stage holds some): its routers, counted on the meta device.
    router = "." + spec.moe["router"]
    moe_layers = sum(1 for name, _ in spec.build(hf_config).named_modules() if name.endswith(router))
    sizes = {"experts": experts, "moe_layers": moe_layers, "seq_len": cfg.model.seq_len, "top_k": top_k}
    return RouterLoss(modules, spec.moe, **sizes, coef=coef, cp_group=cp_group)


def moe_metrics(moe: dict) -> dict:
    """A step's metrics from RouterLoss.reduce (none for a dense model)."""
    if not moe:
        return {}
    # (the routers' weighted auxiliary loss: part of the step's "loss", as transformers adds it to its loss)
    out = {"router_aux_loss": float(moe["aux"]), "expert_load": moe["expert_load"].int().tolist()}
    if "dropped_tokens" in moe:
        out["dropped_tokens"] = int(moe["dropped_tokens"])
    return out
