"""The platform benchmark: the whole stack (gateway → Ray Serve engine → vLLM, adapters paged from S3) under
saturating Locust load, read from Prometheus, against `vllm serve` peers on the same machine.

    python -m loadtest.platform --preset llama8b --out loadtest/results/gpu-platform   # GPU (loadtest/gpu_stage.sh)
    .venv/bin/python -m loadtest.platform --preset cpu-tiny --out /tmp/cpu-platform     # the same, tiny, on CPU
"""
