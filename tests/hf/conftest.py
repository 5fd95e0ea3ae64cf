"""The ``hf`` fixture: ``mode.hf``, or the test is skipped when transformers is not installed (CI installs only
``.[test]``)."""

import pytest


@pytest.fixture
def hf():
    pytest.importorskip("transformers", reason="mode.hf needs transformers 5.x: pip install -e '.[hf]'")
    import mode.hf as mh

    return mh
