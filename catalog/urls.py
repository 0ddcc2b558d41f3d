from django.urls import path

from catalog import apis

urlpatterns = [
    path("models/", apis.ModelListApi.as_view(), name="model-list"),
    path("models/<str:version>/prices/", apis.VersionPriceApi.as_view(), name="version-prices"),
    path("models/<str:version>/profile/", apis.VersionProfileApi.as_view(), name="version-profile"),
    path(
        "models/<str:version>/prices/<int:price_id>/withdraw/",
        apis.VersionPriceWithdrawApi.as_view(),
        name="version-price-withdraw",
    ),
]
