from django.contrib import admin
from django.urls import include, path, re_path
from drf_spectacular.views import (
    SpectacularAPIView,
    SpectacularRedocView,
    SpectacularSwaggerView,
)

from fairway import health
from fairway.api_errors import api_not_found

api_v1 = [
    path("", include("tenants.urls")),
    path("", include("catalog.urls")),
    path("", include("metering.urls")),
    path("", include("billing.urls")),
]

urlpatterns = [
    # Answered by fairway.health.HealthMiddleware first; routed here too for reverse().
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema"), name="api-redoc"),
    re_path(r"^api/", api_not_found),
    path("", include("console.urls")),
]
