#!/usr/bin/env bash
# bench/gpu_check.sh on a GPU machine that has torch (CUDA), pytest and the
# test tools but no Jupyter pieces and no network. The wheels it lacks travel
# in .whl/ (untracked; fetched here with `pip download --no-deps
# --only-binary=:all: --python-version 3.12 ...`) and are installed with
# --target into $SITE, which PYTHONPATH puts in front for this script, the
# test process, its kernels and their ranks. Run from anywhere, e.g.
#     OUT=/tmp/out bash bench/gpu_device.sh
# Everything printed also goes to $OUT/gpu_check.txt; the exit status is
# gpu_check.sh's.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nblaunch-gpu-out}
mkdir -p "$OUT"
PY=$(command -v "${PYTHON:-python3}")
SITE=${SITE:-/tmp/site}
JPREFIX=/tmp/nblaunch-jupyter   # the kernel spec the tests' Kernel ("python3") starts

main() {
    set -e
    export PIP_ROOT_USER_ACTION=ignore   # (an env var: older pips lack the option)
    echo "== python: $PY ($("$PY" -V 2>&1)), repo $PWD, $(ls .whl/*.whl | wc -l) wheels"
    # (a) the wheels, into $SITE; without pip in this python, unpacked (a
    # wheel is a zip of what goes into site-packages).
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl; then
        echo "pip install failed; unpacking the wheels instead"
        "$PY" - "$SITE" .whl/*.whl <<'PYEOF'
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
PYEOF
    fi
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=1
    # Offline: gpu_check.sh's `pip install nvidia-ml-py` answers at once
    # (already satisfied, or not found) instead of retrying a network.
    export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
    # Jupyter's and IPython's own files in /tmp, not in a home that may not be writable.
    export JUPYTER_RUNTIME_DIR=/tmp/nblaunch-jupyter-runtime IPYTHONDIR=/tmp/nblaunch-ipython
    # (b) the "python3" kernel spec: this python (its argv[0] is sys.executable),
    # found first (JUPYTER_PATH), whatever specs this machine has elsewhere.
    # The kernel gets the test process's environment, so PYTHONPATH too.
    # (It warns that the prefix is not on Jupyter's path: JUPYTER_PATH puts it there.)
    spec_log=$("$PY" -m ipykernel install --prefix "$JPREFIX" --name python3 2>&1) || { echo "$spec_log"; exit 1; }
    export JUPYTER_PATH="$JPREFIX/share/jupyter"
    echo "== preflight: the kernel spec, and a kernel that imports what the tests need"
    set +e
    timeout 150 "$PY" - <<'PYEOF'
import sys, time
sys.path.insert(0, "tests")
import ipykernel, ipywidgets, jupyter_client, nbval, zmq
from jupyter_client.kernelspec import KernelSpecManager
print("ipykernel", ipykernel.__version__, "ipywidgets", ipywidgets.__version__,
      "jupyter_client", jupyter_client.__version__, "libzmq", zmq.zmq_version())
print("kernel argv:", KernelSpecManager().get_kernel_spec("python3").argv)
from conftest import Kernel
t = time.monotonic()
k = Kernel()
try:
    r = k.execute("import sys, torch, ipykernel, ipywidgets, nblaunch\n"
                  "print(sys.executable, 'torch', torch.__version__, 'cuda', torch.version.cuda,"
                  " 'GPUs', torch.cuda.device_count())", timeout=120)
    print(f"kernel ({time.monotonic() - t:.1f} s):", r.stdout.strip())
    if r.error:
        import re
        print(re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(r.error.get("traceback", []))))
        sys.exit(1)
finally:
    k.shutdown()
PYEOF
    echo "== preflight exit $?"
    set -e
    # (c) the check itself.
    PYTHON="$PY" bash bench/gpu_check.sh
}

main 2>&1 | tee "$OUT/gpu_check.txt"
status=${PIPESTATUS[0]}
echo "== gpu_check.sh exit $status" | tee -a "$OUT/gpu_check.txt"
exit "$status"
