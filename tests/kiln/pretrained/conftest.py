"""Fixtures of the pretrained-import tests: tiny random transformers model folders, saved once for the folder's tests."""

import pytest

from hfmodels import save_tiny
from tests.kiln.pretrained.pretrained_kit import CASES


@pytest.fixture(scope="package")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {(a, s): save_tiny(root / f"{a}-{s}", a, s, shards=sh) for a, s, sh in CASES}
