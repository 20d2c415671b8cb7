import os

import pytest

from tests.hf_models import FAMILIES, make_hf_model, save_hf_model


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """Returns ``(hf_model, directory)`` for a family, built once per session."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model = make_hf_model(family)
            directory = save_hf_model(model, str(tmp_path_factory.mktemp(family)))
            cache[family] = (model, directory)
        return cache[family]

    return get
