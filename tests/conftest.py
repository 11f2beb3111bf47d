import os

import pytest
import torch

import asap_comm


@pytest.fixture
def comm1():
    """A one-PE communicator in this process (no spawn): for argument and timeout checks."""
    c = asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=0, timeout=5.0)
    yield c
    c.close()


@pytest.fixture(autouse=True)
def _torch_threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
