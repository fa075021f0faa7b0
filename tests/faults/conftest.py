def pytest_addoption(parser):
    parser.addoption("--soak-minutes", type=float, default=0.0,
                     help="run the soak test (tests/faults/test_soak.py) for this many minutes")  # fmt: skip
