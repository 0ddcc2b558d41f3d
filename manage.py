#!/usr/bin/env python
"""Django's command-line utility. Without DJANGO_SETTINGS_MODULE: production settings under
FAIRWAY_ENV=production, development ones otherwise."""

import sys


def main() -> None:
    from fairway.env import set_default_settings_module

    set_default_settings_module()
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
