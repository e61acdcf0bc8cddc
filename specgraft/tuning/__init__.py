"""Choosing a draft setting for a device: ``cost`` (the measured cost profile, `specgraft profile`), ``search``
(what a head family's search is built from), ``simulate`` (closed-form predictions, `specgraft simulate`) and
``tune`` (calibrate, search, confirm: `specgraft tune`); ``settings`` holds their import-light defaults.
"""
