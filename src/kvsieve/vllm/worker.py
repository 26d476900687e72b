"""vLLM's CPU worker with kvsieve's state: built once the model is loaded, told of finished requests, reporting
each step's compactions to the scheduler on the model runner's output."""

from __future__ import annotations

import copy

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from ..modeling.architecture import attention_module, decoder_layers, output_projection
from ..modeling.rotary import find_rotary
from ..selection.checkpoint import load_gates
from ..selection.merge import recorded_merge_needs
from . import worker_state
from .compaction import WorkerSieve
from .layout import CPUCacheLayout
from .settings import CONFIG_KEY, PluginSettings


def transformers_model(path: str) -> torch.nn.Module:
    """The served model as `transformers` loads it (CPU, bfloat16): what ties retention gates to their model, the
    rotary embedding kvsieve undoes to read keys as the gates were trained on them, and each layer's `W_o`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def worker_sieve(settings: PluginSettings, runner: object, model_path: str) -> WorkerSieve:
    """The worker's kvsieve state, with the gates and rotary embedding the policy reads (checked against the model),
    recording what the merge its gates' checkpoint records reads (for a policy that names no merge)."""
    policy, needs = settings.policy, settings.policy.needs
    sieve = WorkerSieve(settings, runner, CPUCacheLayout(), needs=needs)
    if needs.gates or needs.rotary or needs.output_projection:
        model = transformers_model(model_path)
        sieve.gates = {source: load_gates(source, model).float() for source in needs.gates}
        model = model.float()
        sieve.rotary = find_rotary(model)
        if needs.output_projection:
            layers = (attention_module(layer) for layer in decoder_layers(model))
            sieve.output_weights = {index: output_projection(module) for index, module in enumerate(layers)}
    if policy.merge is None:
        sieve.needs = policy.needs | recorded_merge_needs(sieve.gates.values())
    return sieve


class SieveCPUWorker(CPUWorker):
    """vLLM's CPU worker, keeping kvsieve's state for the engine's requests."""

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        entry = (self.vllm_config.additional_config or {}).get(CONFIG_KEY)
        self.kvsieve = None
        if entry is not None:
            model_path = self.vllm_config.model_config.model
            self.kvsieve = worker_sieve(PluginSettings.parse(entry), self.model_runner, model_path)
        worker_state.install(self.kvsieve)  # what the attention backend's builder, built next, takes

    def execute_model(self, scheduler_output, *args, **kwargs):
        if self.kvsieve is not None:
            self.kvsieve.forget(scheduler_output.finished_req_ids)
            self.kvsieve.forget(scheduler_output.preempted_req_ids or ())
            self.kvsieve.shared = getattr(scheduler_output, "kvsieve_shared", {})
        return super().execute_model(scheduler_output, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        output = super().sample_tokens(*args, **kwargs)
        evictions = self.kvsieve.take_evictions() if self.kvsieve is not None else {}
        if evictions and output is not None:
            output = copy.copy(output)  # never mark an output object vLLM reuses
            output.kvsieve_evicted = evictions
        return output
