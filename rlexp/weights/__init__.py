"""Weight transfer: how one version of the trainer's weights reaches the rollout engine, both
halves (the sender in the trainer's process, the receiver in the engine's).

A transport (`protocols.WeightTransport`) takes the trainer's full tensors by name
(`Trainer.weights()`, one at a time) and makes the engine serve them as policy `version` (the
loop's number). The scheduler decides *when* (between batches, or with the engine paused); the
transport decides *how*. `weight_transfer=auto` (auto.py) picks the one that fits the cluster:

    one node, no GPU                ram_file      (ram_file.py; every engine maps the same file)
    replicas on other nodes         object_store  (object_store.py: Ray's object store)
    GPU, vLLM, placement=colocate   vllm_ipc      (vllm_ipc.py: CUDA IPC handles)
    GPU, vLLM, placement=split      vllm_nccl     (vllm_nccl.py: NCCL broadcast)

A LoRA run can send its adapter instead (`weight_transfer=lora_adapter`, adapter_file.py: peft's
files in RAM, served by vLLM's LoRA support on the base weights it loaded once; a Ray pool
ships the files to its replicas' nodes through the object store); a transport that
`sends_adapter` gets `trainer.adapter_weights()` (rlexp.step.outgoing).

An engine receives through declared methods (protocols.py): `load_weights` (a safetensors file
it can read), `load_adapter` (a LoRA adapter's files, by name), `load_weights_object` (a
RolloutPool: Ray's object store), `load_weights_native` (vLLM's native transfer, process by
process). Inside vLLM's workers, vllm_worker.py loads the file in place; vllm_private.py
lists the places where that reaches past vLLM's public API.

This package imports nothing from rlexp's rollout, trainer or cluster packages: they import it."""
