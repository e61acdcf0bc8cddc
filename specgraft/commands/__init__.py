"""One module per ``specgraft`` subcommand: its ``add_arguments(parser)`` and a ``run(args)`` that turns the parsed
arguments into typed calls of the library (:mod:`specgraft.pipeline`, the trainers, the exporters, ...).

``specgraft --help`` and ``specgraft CMD --help`` build a subcommand's parser from the module named in
:data:`specgraft.cli.COMMANDS`, so these modules import no heavy library at module level: ``run`` imports the
implementation when the command runs. No library module below this package parses arguments.
"""
