"""The torch-free copies that `specgraft export --help` reads agree with what the families register."""

from specgraft.export.formats import supported_formats
from specgraft.export.options import FORMATS, FORMATS_PER_FAMILY


def test_help_lists_the_registered_formats_per_family():
    registered = "; ".join(f"{name}: {', '.join(f for f in formats if f != 'native')}"
                           for name, formats in supported_formats().items())
    assert FORMATS_PER_FAMILY == registered


def test_every_registered_format_is_a_cli_choice():
    assert {f for formats in supported_formats().values() for f in formats} <= set(FORMATS)
