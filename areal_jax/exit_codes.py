"""The exit statuses of `areal-jax` commands, which launchers and supervisors act on."""

EXIT_USER_ERROR = 2  # a user mistake (see `cli._user_errors`): one line on stderr, the traceback with --debug
EXIT_RUN_FAILED = 1  # the run stopped itself (failing rollouts, every update skipped): the message says why
EXIT_RESUMABLE = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGINT after writing a checkpoint; rerun with --resume
