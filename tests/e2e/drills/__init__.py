"""What the long cluster tests share: the chaos proof and the failure drills, each a compose project of the real image
(tests/e2e/test_chaos.py, test_failure_drills.py; `make chaos`, `make drills`)."""
