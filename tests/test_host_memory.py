import sys

import pytest

from batchgen.engine.host_memory import retain_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc settings")
def test_retain_freed_memory_applies_on_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert retain_freed_memory()
    assert retain_freed_memory()  # idempotent
