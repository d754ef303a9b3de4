"""The per-worker trainer: one class for every (dp, tp, pp, schedule, zero) layout."""

from __future__ import annotations

import dataclasses
import functools
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from raytrain_hybrid.checkpoint.hf_load import fetch_pretrained, load_hf_weights
from raytrain_hybrid.config import Config
from raytrain_hybrid.data.corpus import IGNORE_INDEX, Batch
from raytrain_hybrid.distributed import pipeline
from raytrain_hybrid.distributed.context_parallel import local_slice, use_cp_attention
from raytrain_hybrid.distributed.data_parallel import build_optimizer
from raytrain_hybrid.distributed.fp8 import require_fp8_device
from raytrain_hybrid.distributed.lora import init_adapters, place_dropout, start_dropout_step
from raytrain_hybrid.distributed.parallel_dims import ParallelDims
from raytrain_hybrid.distributed.parallelize import parallelize_stage
from raytrain_hybrid.distributed.tensor_parallel import align_grad_placements
from raytrain_hybrid.distributed.utils import clip_grads_, global_grad_norm
from raytrain_hybrid.distributed.zero1 import ZeroOneOptimizer
from raytrain_hybrid.engine.compile_clock import CompileClock
from raytrain_hybrid.engine.loss import TokenLoss, lr_factor, make_loss, make_router_loss, moe_metrics
from raytrain_hybrid.engine.tied import TiedEmbedding
from raytrain_hybrid.models import get_arch, hf_checkpoint, lora
from raytrain_hybrid.models.common import build_stage, full_init_state_dict
from raytrain_hybrid.models.flops import device_peak_tflops, flops_per_token, tokens_per_row


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


class Trainer:
    def __init__(self, cfg: Config, dims: ParallelDims, mesh, device: torch.device) -> None:
        self.cfg, self.dims, self.mesh, self.device = cfg, dims, mesh, device
        # The process's peak before the model exists (interpreter, imports, process group): what the
        # training itself adds on a CPU is the peak RSS above it.
        self.rss_before_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        par = cfg.parallelism
        self.spec = get_arch(cfg.model.arch)
        # A language model's Hugging Face checkpoint: a directory on this node, or a URI read by range.
        self.pretrained = None
        if hf_checkpoint.is_set(cfg.model.pretrained) and self.spec.from_hf is not None:
            self.pretrained = fetch_pretrained(cfg.model.pretrained, cfg.model.pretrained_revision)
        self.hf_config = self.spec.hf_config(cfg)
        # Context parallelism: this rank's slice of every sequence; attention exchanges the rest.
        self.cp_rank = mesh.cp.get_local_rank() if dims.cp > 1 else 0
        if dims.cp > 1:
            use_cp_attention(self.hf_config)
        self.loss_fn = make_loss(cfg, self.spec.task, device)
        self.pp_rank = mesh.pp.get_local_rank()
        self.dp_rank = mesh.dp.get_local_rank()
        num_stages = par.num_stages if dims.pp > 1 else 1
        split = pipeline.split_layers(self.spec.num_blocks(cfg.model), num_stages)
        ids = pipeline.stage_ids(par.schedule, self.pp_rank, dims.pp, par.stages_per_rank) if dims.pp > 1 else [0]
        self.stage_ids = ids
        # parallelism.compile "auto": on GPUs (the compiled blocks pay off there), off on CPU; off for
        # a mixture of experts, whose routing gives every step new shapes (each expert's tokens):
        # a hand-written one, or a generic family with experts (expert_params, ep or not).
        auto = device.type == "cuda" and self.spec.moe is None and not self.spec.expert_params(cfg.model)
        self.compiled = par.compile if par.compile is not None else auto
        self.compile_clock = CompileClock() if self.compiled else None
        require_fp8_device(cfg.train.fp8, cfg.train.fp8_emulate, device)  # train.fp8: float8 matmuls here
        self.has_first = 0 in ids
        self.has_last = num_stages - 1 in ids
        self.tied = TiedEmbedding.of(self.spec, self.hf_config, mesh, dims, par, num_stages)
        self.modules = [self._build(sid, split[sid], num_stages) for sid in ids]
        # What the optimizer trains: with LoRA the adapters only (the base is frozen: no gradient,
        # no optimizer state, in no DP bucket or ZeRO-1 slice).
        self.params = [p for m in self.modules for p in m.parameters() if p.requires_grad]
        # Mixture of experts: the routers' auxiliary loss and the experts' load (None: dense).
        cp_group = mesh.cp.get_group() if dims.cp > 1 else None  # a sequence's routing spans its cp ranks
        self.router_loss = make_router_loss(cfg, self.spec, self.hf_config, self.modules, cp_group)
        assert cfg.train.lr > 0, "train.lr=0 means 'pick one': config.resolve_defaults() sets it"
        self.optimizer = build_optimizer(
            self.params,
            mesh,
            dims,
            lr=cfg.train.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=cfg.train.weight_decay,
            device=device,
        )
        if self.tied is not None:
            self.tied.bind(self.modules, self.optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(
                s, warmup=cfg.train.warmup_steps, total=cfg.train.steps, min_ratio=cfg.train.min_lr_ratio
            ),
        )
        self.schedule = None
        if dims.pp > 1:
            stages = [
                PipelineStage(m, sid, num_stages, device, group=mesh.pp.get_group(), **self._stage_io(split[sid]))
                for m, sid in zip(self.modules, ids, strict=True)
            ]
            self.schedule = pipeline.build_schedule(par.schedule, stages, par.microbatches, self.loss_fn)
        self.grad_bytes = 0
        self.flagged = False  # any rank's flag at the last train_step
        # [fault_tolerance]: this group's side of the replica groups' quorum (engine.replicas), set by
        # the worker once the trainer is built (its state is what a rejoining group receives).
        self.replicas = None
        self.flops_per_token = flops_per_token(cfg.model)
        self.peak_tflops = device_peak_tflops(device)

    def _stage_io(self, blocks: list[int]) -> dict:
        if self.spec.stage_io is None:
            return {}  # inferred by torch.distributed.pipelining on the first step
        rows = self.cfg.train.global_batch_size // self.dims.dp // self.cfg.parallelism.microbatches
        seq = self.cfg.model.seq_len // self.dims.cp
        inputs, outputs = self.spec.stage_io(self.hf_config, blocks, rows, seq, self.device)
        return {"input_args": inputs, "output_args": outputs}

    def restore_schedule(self, steps_done: int) -> None:
        """Put the LR schedule where it is after ``steps_done`` optimizer steps."""
        t = self.cfg.train
        factor = lr_factor(steps_done, warmup=t.warmup_steps, total=t.steps, min_ratio=t.min_lr_ratio)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * factor
        self.scheduler.last_epoch = steps_done
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _build(self, stage_id: int, layer_ids: list[int], num_stages: int):
        stage = build_stage(self.spec, self.hf_config, layer_ids, first=stage_id == 0, last=stage_id == num_stages - 1)
        if self.cfg.lora.rank:  # peft's adapters on the meta stage, before TP lays them out
            # With train.dtype=bfloat16 the frozen base is held in bf16; the adapters train in fp32.
            base_dtype = torch.bfloat16 if self.cfg.train.dtype == "bfloat16" else None
            lora.inject(stage, self.spec, self.cfg.lora, base_dtype)
        shapes = {name: p.shape for name, p in stage.named_parameters()}
        if self.pretrained is not None:  # read later, each rank its own slices only
            full = None
        elif self.spec.initial_state is not None:  # e.g. pretrained weights
            full = self.spec.initial_state(self.cfg, stage, shapes)
        else:
            full = full_init_state_dict(stage, self.cfg.train.seed, self.cfg.train.init_std, shapes)
            if self.tied is not None:  # the head starts as the embedding, wherever each lives
                self.tied.initial(full, shapes, self.cfg.train.seed, self.cfg.train.init_std)
        # Buffers computed at build (rotary tables, an embedding scale; not in any state dict),
        # kept by module: materialising the stage below leaves them uninitialised.
        buffers = [
            (mod, name, buf.clone())
            for mod in stage.modules()
            for name, buf in mod._buffers.items()
            if buf is not None and not buf.is_meta
        ]
        parallelize_stage(
            stage,
            self.spec,
            self.mesh,
            self.dims,
            activation_checkpointing=self.cfg.parallelism.activation_checkpointing,
            # Only architectures with a sequence-parallel plan run it.
            sequence_parallel=self.cfg.parallelism.sequence_parallel and self.spec.sequence_parallel,
            compile=self.compiled,
            fp8=self.cfg.train.fp8,
            fp8_emulate=self.cfg.train.fp8_emulate,
        )
        stage.to_empty(device=self.device)
        for mod, name, value in buffers:
            mod._buffers[name] = value.to(self.device)
        if self.spec.init_buffers is not None:
            self.spec.init_buffers(stage, self.hf_config, self.device)
        if full is None:
            load_hf_weights(stage, self.spec, self.cfg.model.pretrained, self.pretrained)
            if self.cfg.lora.rank:
                init_adapters(stage, self.cfg.train.seed)
                # lora.dropout: this replica's first row in the global batch, the cp slice of each row.
                first_row = self.dp_rank * (self.cfg.train.global_batch_size // self.dims.dp)
                place_dropout(stage, self.cfg.train.seed, first_row, (self.cp_rank, self.dims.cp))
        else:  # every rank holds the same full values; each keeps its own TP/FSDP shard
            set_model_state_dict(stage, full, options=StateDictOptions(full_state_dict=True, strict=True))
        if self.dims.tp > 1 and not isinstance(stage, FSDPModule):
            align_grad_placements(stage)
        return stage

    def _autocast(self):
        enabled = self.cfg.train.dtype == "bfloat16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        """A batch tensor on this rank's device; to a GPU through pinned memory, without waiting
        for the copy (the stream orders it before the forward that reads it)."""
        if self.device.type != "cuda":
            return x.to(self.device)
        return x.pin_memory().to(self.device, non_blocking=True)

    def _cp_slice(self, batch: Batch) -> Batch:
        """Under context parallelism, this rank's contiguous 1/cp of every row's tokens and labels."""
        if self.dims.cp == 1:
            return batch
        cut = functools.partial(local_slice, cp=self.dims.cp, rank=self.cp_rank)
        return dataclasses.replace(batch, inputs=tuple(cut(x) for x in batch.inputs), labels=cut(batch.labels))

    def _forward_backward(self, batch: Batch) -> torch.Tensor:
        """Returns this rank's share of its replica's mean loss on ranks that hold the last stage
        (the whole of it without cp), else 0."""
        m = self.cfg.parallelism.microbatches
        batch = self._cp_slice(batch)
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            args = tuple(self._to_device(x) for x in batch.inputs) if self.has_first else ()
            kwargs = {"target": self._to_device(batch.labels), "losses": losses} if self.has_last else {}
            with self._autocast():
                self.schedule.step(*args, **kwargs)
            if not self.has_last:
                return torch.zeros((), device=self.device)
            return torch.stack([loss.detach().float() for loss in losses]).mean()
        (module,) = self.modules
        xs = list(zip(*(self._to_device(x).chunk(m) for x in batch.inputs), strict=True))
        ys = self._to_device(batch.labels).chunk(m)
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            self._set_grad_reduction(module, reduce=i == m - 1)
            with self._autocast():
                loss = self.loss_fn(module(*x), y)
            (loss / m).backward()
            total += loss.detach().float() / m
        return total

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor | None:
        """Forward only, in eval mode: the logits on ranks holding the last stage, else None.
        The batch must have the training replica batch's row count (pipeline shapes are fixed)."""
        for module in self.modules:
            module.eval()
        try:
            with self._autocast():
                if self.schedule is not None:
                    args = tuple(x.to(self.device) for x in batch.inputs) if self.has_first else ()
                    # The schedule computes its loss on the last stage, so it needs the labels.
                    kwargs = {"target": batch.labels.to(self.device), "losses": []} if self.has_last else {}
                    out = self.schedule.eval(*args, **kwargs)
                    return out.float() if self.has_last else None
                (module,) = self.modules
                return module(*(x.to(self.device) for x in batch.inputs)).float()
        finally:
            for module in self.modules:
                module.train()

    @staticmethod
    def _set_grad_reduction(module, *, reduce: bool) -> None:
        """Whether the next backward reduces gradients across replicas: an FSDP module does so
        on the last micro-batch only (ZeRO-1 reduces once per step, in the optimizer)."""
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(reduce)

    def train_step(self, step: int, batch: Batch, flag: bool = False) -> dict:
        """One optimizer step. ``flag``: this rank's vote (e.g. it heard of a preemption); after
        the step ``self.flagged`` says whether any rank voted. The vote rides on the step's loss
        all-reduce, so the ranks agree on it at the same step without a collective of its own."""
        t0 = time.perf_counter()
        compiled_before = self.compile_clock.reading() if self.compile_clock else None
        lr = self.optimizer.param_groups[0]["lr"]
        counted = None
        if isinstance(self.loss_fn, TokenLoss):
            counted = self._counted_labels(batch)
            # Gradients are averaged over dp x cp: each cp rank sums the loss of its tokens.
            self.loss_fn.start_step(counted, self.cfg.parallelism.microbatches, self.dims.dp * self.dims.cp)
        if self.router_loss is not None:
            m, scheduled = self.cfg.parallelism.microbatches, self.schedule is not None
            self.router_loss.start_step(self.cfg.train.global_batch_size, self.dims.dp * self.dims.cp, m, scheduled)
        if self.cfg.lora.dropout:  # the adapters' dropout masks are a function of the step
            start_dropout_step(self.modules, step)
        replica_loss = self._forward_backward(batch)
        if self.tied is not None:
            self.tied.sum_grads()
        # Exactly dp*cp*tp ranks hold the last stage, each with its replica's loss (times cp, its
        # tokens' share of it under cp: the cp ranks' shares add up to cp times the replica's).
        summed = torch.stack([replica_loss.detach().reshape(()), replica_loss.new_tensor(float(flag))])
        dist.all_reduce(summed)
        ranks_per_stage = self.dims.dp * self.dims.cp * self.dims.tp
        loss, self.flagged = summed[0] / ranks_per_stage, bool(summed[1] > 0)
        moe = self.router_loss.reduce(self.dims.tp) if self.router_loss is not None else {}
        if moe:  # the step's loss includes the routers' auxiliary loss
            loss = loss + moe["aux"]
        in_step = None
        if self.replicas is not None:  # the replica groups' gradients, weighted by their tokens
            tokens = counted if counted is not None else self.cfg.train.global_batch_size
            loss, in_step, aux = self.replicas.combine(loss, tokens, moe.get("aux"))
            if moe:  # (reported as the loss is: over every group's tokens)
                moe["aux"] = aux
        self.grad_bytes = sum(_local_bytes(p.grad) for p in self.params if p.grad is not None)
        if isinstance(self.optimizer, ZeroOneOptimizer):
            norm = self._zero1_reduce_and_clip()
        else:
            in_norm = self.params if self.tied is None else self.tied.counted(self.params)
            norm = global_grad_norm(in_norm, ranks_per_stage, self.device)
            clip_grads_(self.params, self.cfg.train.grad_clip, norm)
        # With fault tolerance, the update only when every group in the quorum finished the step.
        committed = self.replicas is None or self.replicas.should_commit()
        if committed:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The step's only host synchronisation: everything above is queued on the device.
        loss_value, norm_value = loss.item(), norm.item()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        tokens = self.cfg.train.global_batch_size * tokens_per_row(self.cfg.model)
        tflops = self.flops_per_token * tokens / elapsed / self.dims.world_size / 1e12
        return {
            "step": step,
            "loss": loss_value,
            "grad_norm": norm_value,
            "lr": lr,
            "step_time_s": elapsed,
            "tokens_per_s": tokens / elapsed,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "dp": self.dims.dp,  # replicas of this step (an elastic run's changes with the nodes)
            **({"loss_tokens": counted} if counted is not None and self._masked else {}),  # labels the loss counted
            **(self._compiled_in_step(compiled_before) if compiled_before else {}),
            **moe_metrics(moe),
            **({"replicas_in_step": in_step, "committed": committed} if in_step is not None else {}),
        }

    def _compiled_in_step(self, before: tuple[int, float]) -> dict:
        """torch.compile's work during the step: compilations (after the first step, each one is
        a recompilation) and their seconds."""
        compiles, seconds = self.compile_clock.reading()
        return {"compiles": compiles - before[0], "compile_s": round(seconds - before[1], 3)}

    @property
    def _masked(self) -> bool:
        """Whether batches carry label masks: chat / prompt_completion data, or packed rows."""
        return self.cfg.data.format != "text" or self.cfg.data.packing

    def _counted_labels(self, batch: Batch) -> int:
        """The labels the step's loss counts, over the whole global batch. Every rank of a replica
        holds the replica's batch, so each adds the replicas' counts over its dp group: every
        rank, first pipeline stage to last, knows it before the step."""
        if not self._masked:  # no masks: every label of every row
            return self.cfg.train.global_batch_size * self.cfg.model.seq_len
        counted = (batch.labels != IGNORE_INDEX).sum().to(self.device)
        if self.dims.dp > 1:
            dist.all_reduce(counted, group=self.mesh.dp.get_group())
        return int(counted.item())

    def _zero1_reduce_and_clip(self) -> torch.Tensor:
        """Reduce-scatter gradients, then the global norm over the DP slices, and clip them."""
        self.optimizer.reduce_gradients()
        sq = self.optimizer.grad_norm_sq()
        dist.all_reduce(sq)
        norm = sq.sqrt().float()
        if self.cfg.train.grad_clip > 0:  # a device tensor: no host synchronisation before the update
            self.optimizer.clip_(torch.clamp(self.cfg.train.grad_clip / (norm + 1e-6), max=1.0))
        return norm

    def memory_stats(self) -> dict:
        """Bytes this rank holds: its parameter shards, gradient shards and optimizer state."""
        opt = getattr(self.optimizer, "optim", self.optimizer)  # ZeRO-1: the AdamW of this rank's slice
        opt_bytes = sum(_local_bytes(v) for state in opt.state.values() for v in state.values() if torch.is_tensor(v))
        stats = {
            "param_bytes": sum(_local_bytes(p) for m in self.modules for p in m.parameters()),
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": opt_bytes,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_before_model_bytes": self.rss_before_model,
        }
        if self.device.type == "cuda":
            stats["max_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return stats
