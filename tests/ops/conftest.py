"""Every op test starts from the default dispatch mode."""
import pytest


@pytest.fixture(autouse=True)
def _reset_impl():
    """Every test starts from the default dispatch mode."""
    from megablu.ops import dispatch

    prev = dispatch.get_impl()
    dispatch.set_impl("auto")
    yield
    dispatch.set_impl(prev)
