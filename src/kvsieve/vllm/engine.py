"""Turning the plugin on from `additional_config` alone: vLLM's engine arguments with kvsieve's defaults filled in and
every setting the plugin cannot serve refused, in the user's process, before any worker starts."""

from __future__ import annotations

from .settings import CONFIG_KEY, PluginConfigError, PluginSettings

SCHEDULER = "kvsieve.vllm.scheduler.SieveScheduler"
WORKER = "kvsieve.vllm.worker.SieveCPUWorker"
#: The vLLM releases whose internals the plugin is written against (`docs/vllm.md`).
SUPPORTED_VLLM = ("0.32.0",)


def check_version(version: str) -> None:
    if version not in SUPPORTED_VLLM:
        raise PluginConfigError(
            f"kvsieve's vLLM plugin supports vLLM {', '.join(SUPPORTED_VLLM)} (it extends its scheduler, CPU "
            f"attention backend and KV layout, which change between releases); this is vLLM {version}"
        )


def prepare_engine_args(args: object, version: str) -> None:
    """Check the kvsieve settings of vLLM `EngineArgs` and fill in what the plugin needs: its scheduler and worker.
    Prefix caching is left as asked (vLLM's default: on); the scheduler keeps it true (`SieveScheduler`)."""
    PluginSettings.parse(args.additional_config[CONFIG_KEY])
    check_version(version)
    for name, ours, default in (("scheduler_cls", SCHEDULER, None), ("worker_cls", WORKER, "auto")):
        given = getattr(args, name)
        if given in (default, ours):
            setattr(args, name, ours)
        else:
            raise PluginConfigError(f"kvsieve runs its own {name} ({ours}); this engine asks for {given!r}")


def check_engine_config(config: object) -> None:
    """Refuse an engine the plugin cannot serve: not on vLLM's CPU backend, parallel, speculative, asynchronous,
    or a model with layers of another attention than full attention."""
    from vllm.platforms import current_platform

    model = config.model_config
    problems = []
    if not current_platform.is_cpu():
        problems.append(f"it runs on {current_platform.device_name}; the plugin serves vLLM's CPU backend only")
    if config.parallel_config.tensor_parallel_size > 1 or config.parallel_config.pipeline_parallel_size > 1:
        problems.append("it is tensor- or pipeline-parallel (one worker is supported)")
    if config.speculative_config is not None:
        problems.append("it decodes speculatively")
    if config.scheduler_config.async_scheduling:
        problems.append("it schedules asynchronously (compaction must finish before the scheduler frees blocks)")
    layer_types = set(getattr(model.hf_text_config, "layer_types", None) or ["full_attention"])
    if model.get_sliding_window() is not None or layer_types != {"full_attention"}:
        problems.append(
            f"its layers are {sorted(layer_types)} with sliding window {model.get_sliding_window()}: only models "
            "whose every layer has full attention are supported (sliding-window layers keep their own window)"
        )
    if model.use_mla or model.is_hybrid or model.is_attention_free:
        problems.append("its attention is MLA, hybrid or absent: nothing kvsieve can evict")
    if problems:
        raise PluginConfigError(f"kvsieve cannot serve this vLLM engine: {'; '.join(problems)}")


def install_engine_defaults() -> None:
    """Wrap `EngineArgs.create_engine_config` (once per process) so a `kvsieve` entry in `additional_config` is checked
    and turns the plugin on; engines without one are untouched."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "kvsieve", False):
        return

    def create_engine_config(self, *args, **kwargs):
        asked = CONFIG_KEY in (self.additional_config or {})
        if asked:
            prepare_engine_args(self, vllm.__version__)
        config = original(self, *args, **kwargs)
        if asked:
            check_engine_config(config)
        return config

    create_engine_config.kvsieve = True
    EngineArgs.create_engine_config = create_engine_config
