"""The behaviour seams: every method and attribute the core calls on a task, a backend's model or a strategy,
by lifecycle phase, with who calls it, when, and a one-line example.

The registration and selection hooks are in :mod:`twinkle_core.hookspecs`; this table is the rest of the
extension surface. ``tests/test_contracts.py`` reads :class:`~twinkle_core.task.Task`,
:class:`~twinkle_core.strategy.Strategy` and the backend section of
:class:`~twinkle_core.model.torch_model.TorchTwinkleModel` live and fails when a public member has no row
here, so a new seam is documented where it is added. ``python -m twinkle_core.contracts`` prints the table
as Markdown (the README's seam table is generated from it).

Importing this module imports nothing heavy: the table is data.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the lifecycle phases, in the order a run meets them
PHASES: tuple[str, ...] = ("build", "step", "evaluate", "checkpoint", "export", "sample")


@dataclass(frozen=True)
class Seam:
    """One behaviour seam: ``owner.name`` is called (or read) by ``called_by`` at ``when``."""

    phase: str
    owner: str  # the class that declares it: "Task", "TorchTwinkleModel", "Strategy", ...
    name: str  # the member (method, property or class attribute)
    called_by: str
    when: str
    example: str

    @property
    def qualified_name(self) -> str:
        return f"{self.owner}.{self.name}"


_TRAINER = "the trainer (twinkle_core.train)"
_RECIPE = "recipe validation (twinkle train, before launch)"
_MODEL = "TorchTwinkleModel"
_CAPS = "twinkle_core.capabilities, at model construction and recipe validation"

SEAMS: tuple[Seam, ...] = (
    # ------------------------------------------------------------------ build
    Seam("build", "Task", "name", "the plugin registry", "when the recipe's `task:` is looked up",
         '`name = "score"`'),
    Seam("build", "Task", "default_loss", "the model (`set_loss`) and recipe validation",
         "when no loss is named", '`default_loss = "mse"`'),
    Seam("build", "Task", "model_kind", _CAPS, "before the network is built (checked against "
         "`supported_model_kinds`)", '`model_kind = "token_value"` (one scalar per token)'),
    Seam("build", "Task", "model_inputs", "the model (`TorchTwinkleModel`)", "every forward: batch keys the "
         "network takes besides the text inputs", '`model_inputs = ("pixel_values", "image_grid_thw")`'),
    Seam("build", "Task", "provides", _RECIPE, "before anything is built: a loss's `requires` must be provided",
         '`provides = frozenset({"preference_pairs"})`'),
    Seam("build", "Task", "check_recipe", "the recipe checker (`recipe_from_dict`, so `twinkle train` too)",
         "once the recipe's types are right, before anything is built (a class method)",
         '`return [] if recipe.data.mode in ("chat", "text") else ["data.mode: ..."]`'),
    Seam("build", "Task", "check_data", _RECIPE, "before launch (`--dry-run` too), per split: what `load_dataset` "
         "would refuse, without tokenizer or model", "`load_samples(path, **self.image_options())`"),
    Seam("build", "Task", "load_dataset", _TRAINER, "once per split, before training",
         "`return [tokenize(row) for row in read_jsonl(path)]`"),
    Seam("build", "Task", "prepare_model", _TRAINER, "once the model is built, before adapters",
         "`self.hidden = model.export_config().hidden_size`"),
    Seam("build", "Task", "adapter_config", "the model (`add_adapter_to_model`)",
         "when an adapter is added, after `prepare_model`", "`return {**config, \"target_modules\": lm_only}`"),
    Seam("build", "TwinkleModel", "lora_target_modules", "services that map LoRA switches to layers (twinkle-server)",
         "when a tenant creates an adapter with train_attn / train_mlp / train_unembed",
         '`return {"attn": ["q_proj", "o_proj"], "mlp": ["up_proj", "down_proj"], "unembed": ["lm_head"]}`'),
    Seam("build", "Task", "prepare_dataset", _TRAINER, "every rank, split train/eval, before resume",
         "`return with_reference_logprobs(model, dataset, cache=output_dir)`"),
    Seam("build", "Task", "micro_batches_per_data_batch", _TRAINER,
         "when a recipe without `train.max_steps` counts its steps", "`return self.epochs * batch_size // mini`"),
    Seam("build", "Task", "loss_options", _TRAINER, "when the loss is set (the recipe's `loss.options` win)",
         '`return {"temperature": self.temperature}`'),
    Seam("build", _MODEL, "build_network", "`TorchTwinkleModel.__init__`", "once, on CPU, before the strategy "
         "wraps it", "`return AutoModelForCausalLM.from_pretrained(self.model_dir)`"),
    Seam("build", _MODEL, "attach_adapter", "`add_adapter_to_model`", "when an adapter is added (config already "
         "narrowed by `Task.adapter_config`)", "`self.module.add_adapter(name, LoraConfig(**config))`"),
    Seam("build", _MODEL, "detach_adapter", "`remove_adapter`", "when an adapter is removed",
         "`self.module.delete_adapter(name)`"),
    Seam("build", _MODEL, "adapter_config_for", "`add_adapter_to_model`", "when an adapter is added, before "
         "`Task.adapter_config` sees the config", "`return LoraConfig(**config) if isinstance(config, dict) else "
         "config`"),
    Seam("build", _MODEL, "describe", "`get_train_configs()`", "for the logs and each checkpoint's "
         "`trainer_state.pt`", '`return {"class": "MyModel", "model_type": "llama"}`'),
    Seam("build", "MultiTenantMixin", "tenant_lora_config", "`add_adapter_to_model` of a multi-tenant model",
         "when a tenant is added, before its rank is checked", "`return LoraSettings.from_config(config, backend=...)"
         ".to_peft()`"),
    Seam("build", "MultiTenantMixin", "lora_rank", "`add_adapter_to_model` of a multi-tenant model",
         "when a tenant is added: above `max_lora_rank` it is refused", "`return lora_config.r`"),
    Seam("build", "Strategy", "name", "the plugin registry", "when `strategy=` is looked up", '`name = "ddp"`'),
    Seam("build", "Strategy", "mesh_dimensions", _CAPS, "before anything is built: other dimensions > 1 are "
         "refused", '`mesh_dimensions = ("dp",)`'),
    Seam("build", "Strategy", "dimension_notes", _CAPS, "when a mesh dimension is refused",
         '`{"tp": "use strategy megatron for tp={size}"}`'),
    Seam("build", "Strategy", "supported_models", _CAPS, "before anything is built",
         '`supported_models = ("MegatronModel",)`'),
    Seam("build", "Strategy", "spec_options", "the model constructor", "when the spec's aliases are folded",
         '`spec_options = frozenset({"sequence_parallel"})`'),
    Seam("build", "Strategy", "shards_state", "`Strategy.model_state_shards`", "when the memory model estimates "
         "a recipe (`twinkle train --dry-run`)", "`shards_state = True` (FSDP2, ZeRO)"),
    Seam("build", "Strategy", "model_state_shards", "the memory model (`twinkle train --dry-run`)", "before launch: "
         "what parameters, gradients and optimizer states are divided by", "`return mesh.world_size`"),
    Seam("build", "Strategy", "splits_vocabulary", "the memory model (`twinkle train --dry-run`)", "before launch: "
         "whether the logits are divided by tp", '`return options.get("vocab_parallel_loss", True)`'),
    Seam("build", "Strategy", "bind_precision", "the model constructor", "when a strategy object was passed "
         "without `precision=`", "`strategy.bind_precision(model.precision)`"),
    Seam("build", "Strategy", "check_world_size", "`setup` and recipe validation (twinkle train, --dry-run too)",
         "before launch with the job's size, and in `setup` with WORLD_SIZE", "`if world_size > 1: raise ConfigError(...)`"),
    Seam("build", "Strategy", "setup", "the model constructor", "once: join the process group, check the mesh",
         "`distributed.init_process_group(accelerator.dist_backend)`"),
    Seam("build", "Strategy", "prepare_precision", "the model constructor", "once, before the network is placed "
         "and wrapped", "`return convert_to_float8_training(module)`"),
    Seam("build", "Strategy", "wrap_module", "the model (`wrapped`)", "on first use, after adapters are added",
         "`return DistributedDataParallel(module)`"),
    Seam("build", "Strategy", "unwrap_module", "the model and checkpoint code", "whenever the plain module "
         "is needed", "`return module.module`"),
    Seam("build", "Strategy", "prepare_optimizer", "the model (`set_optimizer`)", "once per optimizer; returns "
         "the module to run and the `OptimizerHandle`", "`return engine, EngineHandle(optimizer, params, engine=e)`"),
    Seam("build", "Strategy", "describe", "the model's `describe()` / `get_train_configs()`", "for the run's "
         "summary and checkpoints", '`return {"name": self.name, "mesh": self.mesh.to_dict()}`'),
    Seam("build", "TwinkleModel", "supported_strategies", _CAPS, "before anything is built (and the default "
         "strategy: the first of them)", '`supported_strategies = ("megatron",)`'),
    Seam("build", "TwinkleModel", "supported_model_kinds", _CAPS, "before the network is built: the task's "
         "`model_kind` must be one", '`supported_model_kinds = ("causal_lm", "token_value")`'),
    Seam("build", "TwinkleModel", "check_adapter_config", _RECIPE, "before launch: a wrong adapter key fails "
         "once", "`LoraConfig(**config)`"),
    Seam("build", "TwinkleModel", "check_options", _RECIPE, "before launch: `model.options` its `**kwargs` would "
         "refuse fail once", "`check_spec(cls, leftover_options)`"),
    Seam("build", "TwinkleModel", "check_model_directory", _RECIPE, "before anything is built, for a local "
         "`model.model_id` with its own `config.json`", "`read_model_config(path)`"),
    Seam("build", "Loss", "requires", _RECIPE, "before anything is built: a task must `provide` each",
         '`requires = frozenset({"preference_pairs"})`'),
    # ------------------------------------------------------------------ step
    Seam("step", "Task", "collate", "the data loader built by the trainer", "every batch",
         "`return {\"input_ids\": pad(features), \"labels\": ...}`"),
    Seam("step", "Task", "prepare_batch", _TRAINER, "every rank, before each training and evaluation forward",
         '`batch["ref_logps"] = model.forward_only(inputs=batch)["logps"]`'),
    Seam("step", "Task", "next_training_batch", _TRAINER, "every training micro-batch (default: "
         "`prepare_batch(model, draw())`)", "`return self.queue.pop() if self.queue else self.rollout(draw())`"),
    Seam("step", "Task", "reads_logits", "the model (fused LM head)", "every `forward_backward`: False lets a "
         "loss apply the LM head itself", "`reads_logits = False`"),
    Seam("step", "Task", "process_outputs", "the model, inside the strategy's forward context", "every forward, "
         "training and evaluation, before the loss", '`return {**outputs, "scores": outputs["logits"][:, -1, 0]}`'),
    Seam("step", "Task", "after_step", _TRAINER, "every rank, after each optimizer step", "`self.sampler.sync("
         "model)`"),
    Seam("step", "Task", "step_metrics", _TRAINER, "every rank, at each logging step", '`return {"reward_mean": '
         'mean}`'),
    Seam("step", "Task", "close", _TRAINER, "when training ends, also on an error", "`self.sampler.shutdown()`"),
    Seam("step", _MODEL, "run_network", "the model's forward", "every forward, inside the adapter scope and "
         "the strategy's forward context", "`return {\"logits\": module(**inputs).logits}`"),
    Seam("step", _MODEL, "activate_adapter", "the model's forward", "every forward with an adapter",
         "`return self.module.adapter_scope(name)`"),
    Seam("step", _MODEL, "deactivate_adapters", "`forward_only(disable_adapters=True)`", "a forward of the base "
         "model (a reference model)", "`return self.module.disable_adapter()`"),
    Seam("step", _MODEL, "adapter_parameter_names", "the model (trainable parameters)", "when an adapter's "
         "optimizer is built", '`return [n for n, _ in self.module.named_parameters() if f".{name}." in n]`'),
    Seam("step", _MODEL, "output_layer", "the model (fused LM head)", "once per adapter set, when a loss may "
         "apply the LM head itself", "`return self.module.lm_head`"),
    Seam("step", _MODEL, "train_state", "backends running their own schedule", "every step",
         "`state = model.train_state(adapter_name)`"),
    Seam("step", _MODEL, "step_context", "backends whose schedule fuses forward and backward (Megatron)",
         "every step", "`ctx = self.step_context(adapter_name)` then `with ctx.adapter_scope(): ...`"),
    Seam("step", "Strategy", "averages_gradients", "the strategy's `gradient_average_size`", "every optimizer "
         "step", "`averages_gradients = True`"),
    Seam("step", "Strategy", "dp_size", "the model (`data_parallel`), losses (`LossContext`)", "every step",
         "`return self.mesh.data_parallel_size`"),
    Seam("step", "Strategy", "dp_rank", "the model (`data_parallel`), data sharding", "when loaders are built",
         "`return rank // (world // self.dp_size)`"),
    Seam("step", "Strategy", "dp_group", "the model (`data_parallel`), `global_sum`", "every step",
         "`return self._dp_group`"),
    Seam("step", "Strategy", "loss_context", "the model constructor", "once; handed to every loss call",
         "`return LossContext(dp_group=..., sp_group=self.sp_group)`"),
    Seam("step", "Strategy", "is_main_process", "the trainer and checkpoint code", "before writing shared files",
         "`return distributed.rank() == 0`"),
    Seam("step", "Strategy", "barrier", "the trainer and checkpoint code", "when ranks must meet",
         "`distributed.barrier()`"),
    Seam("step", "Strategy", "prepare_inputs", "the model's forward", "every forward, before the batch moves to "
         "the device", "`return shard_sequence(inputs, self.sp_rank)`"),
    Seam("step", "Strategy", "no_sync", "the model", "accumulation micro-steps before the last",
         "`return module.no_sync()`"),
    Seam("step", "Strategy", "forward_context", "the model's forward", "every forward",
         "`return torch.autocast(device_type, dtype=torch.bfloat16)`"),
    Seam("step", "Strategy", "scale_loss", "the model's backward", "every backward", "`return self.scaler.scale("
         "loss)`"),
    Seam("step", "Strategy", "unscale_gradients", "the model (`clip_grad_norm`, `step`)", "once per optimizer "
         "step, before gradients are measured", "`self.scaler.unscale_(handle.optimizer)`"),
    Seam("step", "Strategy", "backward", "the model's backward", "every micro-batch", "`handle.engine.backward("
         "loss)`"),
    Seam("step", "Strategy", "global_sum", "the model (token counts)", "every optimizer step",
         "`return all_reduce_sum(value, group=self.dp_group)`"),
    Seam("step", "Strategy", "gradient_average_size", "`gradient_scale`", "every optimizer step",
         "`return self.dp_size if self.averages_gradients else 1`"),
    Seam("step", "Strategy", "gradient_scale", "the model", "every optimizer step", "`return self.dp_size / "
         "global_tokens`"),
    Seam("step", "Strategy", "scale_gradients", "the model", "once per optimizer step", "`p.grad.mul_(factor)`"),
    Seam("step", "Strategy", "clip_grad_norm", "the model (`clip_grad_norm`)", "once per optimizer step",
         "`return handle.engine.clip(max_norm)`"),
    Seam("step", "Strategy", "optimizer_step", "the model (`step`)", "once per optimizer step; False: skipped",
         "`return self.precision.step(handle.optimizer)`"),
    Seam("step", "Strategy", "zero_grad", "the model (`zero_grad`)", "after each optimizer step",
         "`handle.optimizer.zero_grad(set_to_none=True)`"),
    Seam("step", "Loss", "__call__", "the model (`calculate_loss`, `forward_backward`)", "every micro-batch; "
         "`context` is the strategy's `LossContext`", "`return LossOutput(loss=nll.sum(), num_tokens=mask.sum())`"),
    Seam("step", "Loss", "fuses_lm_head", "the model", "every `forward_backward`: True gets `hidden_states` and "
         "`lm_head_weight` instead of `logits`", "`return vocab_size > 32_000`"),
    Seam("step", "Metric", "reads_logits", "the model (fused LM head)", "every `forward_backward`",
         "`reads_logits = False`"),
    Seam("step", "TrainState", "open_window", "backends running their own schedule (Megatron's pipeline)",
         "first micro-batch of an accumulation window", "`ctx.state.open_window(local_tokens, strategy)`"),
    Seam("step", "TrainState", "apply_loss", "backends running their own schedule", "every micro-batch",
         "`loss = ctx.state.apply_loss(outputs, inputs, context)`"),
    Seam("step", "TrainState", "scale_for_backward", "backends running their own schedule", "every micro-batch, "
         "before backward", "`ctx.state.scale_for_backward(loss).backward()`"),
    Seam("step", "TrainState", "record_backward", "backends running their own schedule", "every micro-batch, "
         "after backward", "`ctx.state.record_backward(tokens)`"),
    Seam("step", "TwinkleModel", "data_parallel", "the trainer and the RL rollout", "when data is sharded and "
         "counts are reduced", "`view = model.data_parallel; view.sum(tokens)`"),
    Seam("step", "TwinkleModel", "get_train_configs", _TRAINER, "at each log step (`lr`) and in checkpoints",
         '`lr = model.get_train_configs()["optimizer"]["lr"]`'),
    # ------------------------------------------------------------------ evaluate
    Seam("evaluate", "Task", "evaluate", _TRAINER, "at each evaluation, after the evaluation loss",
         '`return {"accuracy": correct / total}`'),
    Seam("evaluate", "Task", "has_eval_loss", _TRAINER, "at each evaluation: False skips the loss on `data.eval`",
         "`has_eval_loss = False`"),
    Seam("evaluate", "Task", "curve_keys", _TRAINER, "at the end of a run, drawing `curves.png`",
         '`curve_keys = ("reward_mean",)`'),
    Seam("step", "Task", "console_keys", _TRAINER, "every logged step, on the console's step line",
         '`console_keys = ("reward_mean", "policy_lag")`'),
    # ------------------------------------------------------------------ checkpoint
    Seam("checkpoint", "Task", "state_dict", _TRAINER, "every checkpoint (each rank's own)",
         '`return {"queue": list(self.queue)}`'),
    Seam("checkpoint", "Task", "load_state_dict", _TRAINER, "on resume, after the model's state",
         '`self.queue = state["queue"]`'),
    Seam("checkpoint", "Task", "save_training_state", "the model's checkpoint writer", "every rank, inside a "
         "training checkpoint's staging directory", '`self.critic.save("critic", output_dir=directory)`'),
    Seam("checkpoint", "Task", "load_training_state", "the model's checkpoint reader", "on resume, every rank",
         '`self.critic.load(os.path.join(directory, "critic"))`'),
    Seam("checkpoint", _MODEL, "local_weights", "`frozen_copy()`", "before `Strategy.load_state_dict`",
         "`return {k: v for k, v in state_dict.items() if self.owns(k)}`"),
    Seam("checkpoint", _MODEL, "write_weights", "the model (`save`)", "on the main process, for every checkpoint",
         "`save_file(state_dict, os.path.join(directory, \"model.safetensors\"))`"),
    Seam("checkpoint", _MODEL, "read_weights", "the model (`load`, resume)", "when a checkpoint is loaded",
         "`return load_file(os.path.join(directory, \"model.safetensors\"))`"),
    Seam("checkpoint", "TwinkleModel", "save_base", _TRAINER, "every rank, once the model is built and before the "
         "recipe's adapter: a base that exists nowhere else (built from a config) is saved for adapters to name",
         '`return self.write_base(os.path.join(output_dir, "base")) if self.model_id is None else None`'),
    Seam("checkpoint", "Strategy", "reshards_checkpoints", "the model (`reshards_checkpoints`), the trainer",
         "on `--resume` with another number of processes", "`reshards_checkpoints = True  # DCP optimizer state`"),
    Seam("checkpoint", "TwinkleModel", "reshards_checkpoints", _TRAINER, "on `--resume`: a changed layout is "
         "accepted or refused", "`return self.strategy.reshards_checkpoints`"),
    Seam("checkpoint", "Strategy", "full_state_dict", "the model (`get_state_dict`, `save`)", "every checkpoint "
         "(collective)", "`return get_model_state_dict(module, options=full)`"),
    Seam("checkpoint", "Strategy", "load_state_dict", "the model (`load`)", "when weights are loaded",
         "`set_model_state_dict(module, state_dict)`"),
    Seam("checkpoint", "Strategy", "save_optimizer_state", "the model (`save`)", "training checkpoints, every rank",
         "`dcp.save(optimizer_state, checkpoint_id=directory)`"),
    Seam("checkpoint", "Strategy", "precision_state", "the model's checkpoint writer", "training checkpoints",
         '`return {"scaler": self.scaler.state_dict()}`'),
    Seam("checkpoint", "Strategy", "load_precision_state", "the model's checkpoint reader", "on resume",
         '`self.scaler.load_state_dict(state["scaler"])`'),
    Seam("checkpoint", "Strategy", "load_optimizer_state", "the model (`resume_from_checkpoint`)", "on resume",
         "`dcp.load(optimizer_state, checkpoint_id=directory)`"),
    # ------------------------------------------------------------------ export
    Seam("export", "Task", "on_export", "the model's checkpoint writer", "main process, inside the directory "
         "just written", '`json.dump({"head": "last_token"}, open(os.path.join(directory, "task.json"), "w"))`'),
    Seam("export", _MODEL, "network", "tasks (`prepare_model`, `on_export`)", "whenever a task needs the "
         "unwrapped network", "`head = model.network.score`"),
    # ------------------------------------------------------------------ sample
    Seam("sample", "TwinkleModel", "generation_module", "in-process samplers", "every rollout: the network in "
         "eval mode with the KV cache and the adapter on", "`with model.generation_module() as gm: gm.generate(...)`"),
    Seam("sample", "TwinkleModel", "export_config", "samplers that build their own copy", "once, when the sampler "
         "is bound", "`return self.module.config`"),
    Seam("sample", "TwinkleModel", "sibling", "the `ppo` task", "once: a new trainable model of the same class "
         "for another task (the critic)", '`critic = model.sibling(task=ValueTask())`'),
    Seam("sample", "Sampler", "bind", "online-RL tasks", "once, every rank, before the first rollout",
         "`self.model = model`"),
    Seam("sample", "Sampler", "sample", "online-RL tasks", "every rollout", "`return [[engine.generate(p, seed=s) "
         "for s in row] for p, row in zip(prompts, seeds)]`"),
    Seam("sample", "Sampler", "sync_weights", "online-RL tasks (`Task.after_step`)", "after each optimizer step, "
         "every rank", "`self.engine.load_weights(model.get_state_dict())`"),
    Seam("sample", "Sampler", "receive_weights", "`push` samplers' weight transport", "when an update arrives",
         "`self.engine.update(update.tensors)`"),
    Seam("sample", "Sampler", "close", "the trainer", "at the end of a run", "`self.engine.shutdown()`"),
    Seam("sample", "Reward", "__call__", "online-RL tasks", "every rollout, per completion",
         "`return [float(c.strip().endswith(\".\")) for c in completions]`"),
    Seam("sample", "Strategy", "forward_is_collective", "in-process samplers", "before decoding: True makes "
         "every rank decode in lockstep", "`return True  # sharded parameters gathered in forward`"),
)


def seams_of(owner: str) -> dict[str, Seam]:
    """The rows of one class, by member name."""
    return {seam.name: seam for seam in SEAMS if seam.owner == owner}


def render_markdown(seams: tuple[Seam, ...] = SEAMS) -> str:
    """The table as Markdown: one section per phase, one row per seam."""
    sections = []
    for phase in PHASES:
        rows = [seam for seam in seams if seam.phase == phase]
        if rows:
            sections.append("\n".join([f"#### {phase}", "", "| seam | called by | when | example |",
                                       "| --- | --- | --- | --- |",
                                       *(f"| `{s.qualified_name}` | {_cell(s.called_by)} | {_cell(s.when)} | "
                                         f"{_cell(s.example)} |" for s in rows)]))
    return "\n\n".join(sections)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


if __name__ == "__main__":
    print(render_markdown())
