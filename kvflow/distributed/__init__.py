"""Tensor and pipeline parallelism: one scheduler in the driver, one worker process per rank.

- `config.py`: the layout (T x P ranks, the backend), checked against the model's shapes;
  each rank's share of the model as a `ModelConfig` (what a rank builds and plans for).
- `parallel_state.py`: torch.distributed process groups (gloo on the CPU, NCCL on CUDA).
- `layers.py`: the weight slices of each rank and the collectives inside a layer.
- `stage.py`: one rank's forward pass over its layer range, hidden states stage to stage.
- `worker.py`: a rank's process: its model shard, its KV pool, its loop over step messages.
- `messages.py`: what the driver sends each step and what comes back.
- `executor.py`: the executors (`mp`) that start, feed and watch the workers.
- `driver_runner.py`: the driver's runner: the scheduler's output in, sampled tokens out.
- `kv_transfer/`: the KV connector that moves a prompt's blocks between instances (prefill/decode
  disaggregation behind `kvflow router`).
"""

from kvflow.distributed.config import ParallelConfig

__all__ = ["ParallelConfig"]
