"""Shared pytest configuration."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long exhaustive checks (deselect with -m 'not slow')")
