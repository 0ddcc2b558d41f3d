from django.contrib import admin
from django.urls import include, path, re_path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from fairway.api_errors import api_not_found

api_v1 = [
    path("", include("tenants.urls")),
    path("", include("catalog.urls")),
]

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    re_path(r"^api/", api_not_found),
    # The console (a later issue) takes over "/"; until then point people at the API docs.
    path("", RedirectView.as_view(url="/api/docs/", permanent=False)),
]
