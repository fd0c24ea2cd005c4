"""Fixtures of the training tests."""

import pytest

from tests.training.tiny_setup import prepare_tiny


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Data, tokenizer and a random tiny model (256 positions), prepared once and only read."""
    return prepare_tiny(str(tmp_path_factory.mktemp("tiny")), n_train=40, n_val=4)
