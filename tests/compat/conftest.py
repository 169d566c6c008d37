"""torch_bin/ holds pytorch's launcher test scripts, run as data: not test modules to collect."""

collect_ignore_glob = ["torch_bin/*"]
