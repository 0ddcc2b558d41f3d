"""WSGI entry point. Production unless DJANGO_SETTINGS_MODULE says otherwise."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fairway.settings.production")

application = get_wsgi_application()
