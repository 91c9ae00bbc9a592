//! What distinct identities cost (`--max-grants-per-version`): each
//! distinct grant of part of a collection has a view of each version, shared
//! by its clients; a new distinct grant past the limit is refused
//! `RESOURCE_EXHAUSTED` naming the flag and counted, while the clients
//! already served keep being served, and a grant no client holds any more
//! makes room. (What a view holds, references and not copies, is the lib
//! test `downstream::encode::tests::views_of_distinct_grants_refer_to_the_whole_and_copy_nothing`.)

use crate::access::{
    as_identity, mtls_flags, names_of, sotw_request, SotwStream, FRONTEND, OTHER, POLICY, SECRETS, SECRET_TYPE, SOTW,
};
use crate::helpers::certs::Ca;
use crate::helpers::{eventually_some, http_get, sample, spawn_gateway};

const THIRD: &str = "spiffe://cluster.local/ns/third/sa/x";

#[tokio::test]
async fn a_new_distinct_grant_past_the_limit_is_refused_naming_the_flag_and_served_ones_stay() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("mesh-ca");
    let mut flags = mtls_flags(dir.path(), &ca, Some(POLICY));
    flags.extend(["--max-grants-per-version".to_owned(), "2".to_owned()]);
    // A process of its own: the counts are this test's.
    let gw = spawn_gateway(None, &flags.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let metric = |metrics: &str, name: &str, label: &str| sample(metrics, name, &[label]);

    // Two namespaces: two distinct grants, each served its own secrets.
    let mut shop = SotwStream::open_on(as_identity(gw.listen, &ca, FRONTEND).await, SOTW).await;
    shop.send(sotw_request(SECRET_TYPE, &[], None));
    let first = shop.recv().await;
    assert_eq!(names_of(&first), ["shop/backend-cert", "shop/frontend-cert"]);
    shop.send(sotw_request(SECRET_TYPE, &[], Some(&first)));
    let mut other = SotwStream::open_on(as_identity(gw.listen, &ca, OTHER).await, SOTW).await;
    other.send(sotw_request(SECRET_TYPE, &[], None));
    assert_eq!(names_of(&other.recv().await), ["other/x-cert"]);

    // A third distinct grant: refused, naming the flag.
    let mut third = SotwStream::open_on(as_identity(gw.listen, &ca, THIRD).await, SOTW).await;
    third.send(sotw_request(SECRET_TYPE, &[], None));
    let status = third.end_status().await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("--max-grants-per-version=2") && status.message().contains(SECRETS),
        "{status:?}"
    );
    let (_, metrics) = http_get(gw.monitoring, "/metrics").await;
    let refused = "mcp_gateway_limit_refusals_total";
    assert_eq!(
        metric(&metrics, refused, "limit=\"max_grants_per_version\""),
        Some(1.0),
        "{metrics}"
    );
    let collection = format!("collection=\"{SECRETS}\"");
    assert_eq!(metric(&metrics, "mcp_gateway_access_grants", &collection), Some(2.0));

    // Another client of a grant already served is served, and the clients
    // served were not touched.
    let mut shop_again = SotwStream::open_on(as_identity(gw.listen, &ca, FRONTEND).await, SOTW).await;
    shop_again.send(sotw_request(SECRET_TYPE, &[], None));
    let again = shop_again.recv().await;
    assert_eq!(
        (names_of(&again), &again.version_info),
        (names_of(&first), &first.version_info),
        "the same view"
    );

    // One namespace's client leaves: its grant makes room for the third.
    drop(other);
    let (_third, served) = eventually_some("the third identity to be served once the other left", || async {
        let mut third = SotwStream::open_on(as_identity(gw.listen, &ca, THIRD).await, SOTW).await;
        third.send(sotw_request(SECRET_TYPE, &[], None));
        let response = third.try_recv().await.ok()?;
        Some((third, response))
    })
    .await;
    assert!(names_of(&served).is_empty(), "no secret of its namespace");
    let (_, metrics) = http_get(gw.monitoring, "/metrics").await;
    assert_eq!(
        metric(&metrics, "mcp_gateway_access_grants", &collection),
        Some(2.0),
        "shop's and the third's"
    );
    drop(shop);
}
