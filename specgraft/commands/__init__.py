"""Argument parsers of the subcommands whose implementation imports torch or transformers.

``specgraft --help`` and ``specgraft CMD --help`` build a subcommand's parser from the module named in
:data:`specgraft.cli.COMMANDS`; for these commands that module is here, so building it imports no heavy library. Each
module holds ``add_arguments(parser)`` and a ``run(args)`` that imports the implementation when the command runs.
"""
