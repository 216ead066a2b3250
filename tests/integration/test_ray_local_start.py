"""`start_local_ray` starts a cluster of its own even where a `ray start` left its address behind (Ray's ray.init()
without an address joins the cluster named in <temp dir>/ray_current_cluster, which outlives that cluster)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = """
import sys
import ray
from preft.stack.ray_local import start_local_ray
start_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=sys.argv[1])
print(ray.get_runtime_context().gcs_address)
ray.shutdown()
"""


def test_a_cluster_left_in_ray_current_cluster_is_not_joined():
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # (short: Ray's socket paths must fit 107 bytes)
    try:
        (temp / "ray_current_cluster").write_text("127.0.0.1:9")  # (a `ray start` head that is gone)
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(temp)], capture_output=True, text=True, timeout=180, check=False
        )
        assert done.returncode == 0, done.stderr[-3000:]
        address = done.stdout.strip().splitlines()[-1]
        assert address.startswith("127.0.0.1:") and address != "127.0.0.1:9", done.stdout
    finally:
        shutil.rmtree(temp, ignore_errors=True)
