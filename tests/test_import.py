import subprocess
import sys


def test_import_fkvstore_loads_no_heavy_dependency():
    code = ("import sys, fkvstore, fkvstore.codec; "
            "bad = [m for m in ('torch', 'triton', 'transformers') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
