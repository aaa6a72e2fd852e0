"""Every test runs inside the test cluster's secret (``tests/internal.py``)."""

from tests.internal import use_test_secret

use_test_secret()
