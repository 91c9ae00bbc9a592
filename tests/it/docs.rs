//! The docs hold together: every relative link of `README.md` and
//! `docs/*.md` names a file that exists, and every `#anchor` a heading of
//! its target, by the slugs GitHub gives headings. Read from the checkout;
//! no network.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

/// The README says how to start and links to the rest: it stays short.
const README_MAX_LINES: usize = 300;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `README.md` and every `docs/*.md`.
fn documents() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files.into_iter().map(|f| f.canonicalize().unwrap()).collect()
}

/// A link found in a document: its destination and the line it is on.
struct Link {
    line: usize,
    destination: String,
}

/// What a Markdown file offers to links and holds of them.
pub(crate) struct Document {
    /// The anchors its headings get (GitHub's slugs, duplicates numbered).
    pub(crate) anchors: BTreeSet<String>,
    links: Vec<Link>,
}

fn options() -> Options {
    Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH | Options::ENABLE_FOOTNOTES
}

/// Reads `text` as GitHub renders it: a heading's anchor is the slug of its
/// rendered text (code spans without their backticks, links as their
/// text), and a link is any inline or reference link or image outside code.
pub(crate) fn read(text: &str) -> Document {
    let line_of = |offset: usize| text[..offset].matches('\n').count() + 1;
    let mut anchors = BTreeSet::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut links = Vec::new();
    let mut heading: Option<String> = None;
    for (event, range) in Parser::new_ext(text, options()).into_offset_iter() {
        match event {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::End(TagEnd::Heading(_)) => {
                let slug = slug(&heading.take().unwrap_or_default());
                // GitHub numbers a repeated slug: `x`, `x-1`, `x-2`.
                let count = seen.entry(slug.clone()).or_insert(0);
                anchors.insert(if *count == 0 {
                    slug.clone()
                } else {
                    format!("{slug}-{count}")
                });
                *count += 1;
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::Start(Tag::Link { dest_url, .. }) | Event::Start(Tag::Image { dest_url, .. }) => links.push(Link {
                line: line_of(range.start),
                destination: dest_url.into_string(),
            }),
            _ => {}
        }
    }
    Document { anchors, links }
}

/// GitHub's heading anchor: lower case, spaces as hyphens, and of the rest
/// only letters, digits, `-` and `_` kept.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The document at `path` (canonical), read once.
fn open<'a>(read_files: &'a mut BTreeMap<PathBuf, Document>, path: &Path) -> Option<&'a Document> {
    if !read_files.contains_key(path) {
        let text = std::fs::read_to_string(path).ok()?;
        read_files.insert(path.to_owned(), read(&text));
    }
    read_files.get(path)
}

/// A destination outside the repository: a URL with a scheme.
fn is_external(destination: &str) -> bool {
    let scheme: String = destination
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '+')
        .collect();
    destination.starts_with("//") || (!scheme.is_empty() && destination[scheme.len()..].starts_with(':'))
}

#[test]
fn headings_get_githubs_anchors() {
    for (heading, anchor) in [
        ("Envoy walkthrough", "envoy-walkthrough"),
        ("Dial-out (`--sink-listen`)", "dial-out---sink-listen"),
        (
            "A stuck client (`STALE`, `SENT`, `NOT SENT`)",
            "a-stuck-client-stale-sent-not-sent",
        ),
        ("`mcp-xds-gateway client`", "mcp-xds-gateway-client"),
        ("MCP over xDS, for istiod 1.8+", "mcp-over-xds-for-istiod-18"),
        ("The index (`/`)", "the-index-"),
    ] {
        let document = read(&format!("# {heading}\n"));
        assert_eq!(document.anchors, BTreeSet::from([anchor.to_owned()]), "{heading}");
    }
    let repeated = read("## Flags\n\n## Flags\n\n```md\n## Flags\n[x](#nowhere)\n```\n");
    assert_eq!(repeated.anchors, BTreeSet::from(["flags".into(), "flags-1".into()]));
    assert!(repeated.links.is_empty(), "a fenced block holds no links");
    assert!(is_external("https://github.com/istio/api") && is_external("mailto:a@b"));
    assert!(!is_external("docs/reference.md#flags") && !is_external("#flags"));
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let files = documents();
    let mut read_files: BTreeMap<PathBuf, Document> = BTreeMap::new();
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let links: Vec<(usize, String)> = open(&mut read_files, file)
            .unwrap_or_else(|| panic!("{} is readable", file.display()))
            .links
            .iter()
            .map(|l| (l.line, l.destination.clone()))
            .collect();
        let name = file
            .strip_prefix(root().canonicalize().unwrap())
            .unwrap()
            .display()
            .to_string();
        for (line, destination) in links {
            if is_external(&destination) {
                continue;
            }
            checked += 1;
            let (path, anchor) = match destination.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (destination.as_str(), None),
            };
            let target = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            if !target.exists() {
                broken.push(format!("{name}:{line}: {destination}: no file {}", target.display()));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            if target.extension().is_none_or(|e| e != "md") {
                broken.push(format!(
                    "{name}:{line}: {destination}: an anchor into a file that is not Markdown"
                ));
                continue;
            }
            let target = target.canonicalize().unwrap();
            let anchors = &open(&mut read_files, &target).expect("the target is readable").anchors;
            if !anchors.contains(anchor) {
                broken.push(format!(
                    "{name}:{line}: {destination}: no heading has the anchor #{anchor} (it has: {})",
                    anchors.iter().cloned().collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    // The docs link to each other and into their sections: a check that
    // found nothing to check would say nothing.
    assert!(checked > 50, "only {checked} relative links in {files:?}");
}

#[test]
fn the_readme_stays_short_and_leads_to_every_doc() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, at most {README_MAX_LINES}"
    );
    let linked: BTreeSet<String> = read(&readme)
        .links
        .iter()
        .map(|l| l.destination.split('#').next().unwrap().to_owned())
        .collect();
    for doc in documents().iter().skip(1) {
        let relative = doc
            .strip_prefix(root().canonicalize().unwrap())
            .unwrap()
            .display()
            .to_string();
        assert!(linked.contains(&relative), "README.md does not link to {relative}");
    }
}

/// Every body row of every table under `heading` (a `##` section of
/// `document`): the text of its first cell and the test names (code spans)
/// in its last, empty where the row names none, so that a row whose test
/// cell was emptied is seen, not dropped.
fn named_tests(document: &str, heading: &str) -> Vec<(String, Vec<String>)> {
    use pulldown_cmark::HeadingLevel::H2;
    /// A cell's text and its code spans.
    type Cell = (String, Vec<String>);
    let mut in_section = false;
    let mut in_head = false;
    let mut named = Vec::new();
    let mut row: Vec<Cell> = Vec::new();
    let mut cell: Option<Cell> = None;
    let mut heading_text: Option<String> = None;
    for event in Parser::new_ext(document, options()) {
        match event {
            Event::Start(Tag::Heading { level: H2, .. }) => heading_text = Some(String::new()),
            Event::End(TagEnd::Heading(H2)) => in_section = heading_text.take().is_some_and(|h| h == heading),
            Event::Start(Tag::TableHead) => in_head = true,
            Event::End(TagEnd::TableHead) => in_head = false,
            Event::Start(Tag::TableRow) => row.clear(),
            Event::Start(Tag::TableCell) => cell = Some(Cell::default()),
            Event::End(TagEnd::TableCell) => row.push(cell.take().unwrap_or_default()),
            Event::End(TagEnd::TableRow) if in_section && !in_head => {
                let first = row.first().map(|(text, _)| text.clone()).unwrap_or_default();
                named.push((first, row.last().map(|(_, codes)| codes.clone()).unwrap_or_default()));
            }
            Event::Text(t) => {
                if let Some(h) = heading_text.as_mut() {
                    h.push_str(&t);
                }
                if let Some((text, _)) = cell.as_mut() {
                    text.push_str(&t);
                }
            }
            Event::Code(c) => {
                if let Some(h) = heading_text.as_mut() {
                    h.push_str(&c);
                }
                if let Some((text, codes)) = cell.as_mut() {
                    text.push_str(&c);
                    codes.push(c.into_string());
                }
            }
            _ => {}
        }
    }
    named
}

/// Whether `source` defines `function` as a test: `fn function(` whose
/// attributes (the lines above it, up to the previous item) hold `test`.
fn defines_test(source: &str, function: &str) -> bool {
    let lines: Vec<&str> = source.lines().collect();
    lines.iter().enumerate().any(|(at, line)| {
        let line = line.trim_start();
        let declares = [format!("fn {function}("), format!("async fn {function}(")]
            .iter()
            .any(|d| line.starts_with(d.as_str()));
        declares
            && lines[..at]
                .iter()
                .rev()
                .map(|l| l.trim_start())
                .take_while(|l| l.starts_with("#[") || l.starts_with("//"))
                .any(|l| l.starts_with("#[") && (l.contains("test]") || l.contains("test(")))
    })
}

/// Where a name in a test column points: `module::function` is a test of
/// `tests/it/module.rs`, `module::*` all of them (at least one), and
/// `path::tests::function` a unit test in `src/path.rs` or
/// `src/path/mod.rs` (the table adds "(lib)"). Anything else (a `file.rs:line`) is refused: a line
/// number drifts with every edit and stops naming the test.
fn resolve(name: &str) -> Result<(), String> {
    let read = |path: PathBuf| std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()));
    if name.contains("::tests::") {
        let parts: Vec<&str> = name.split("::").collect();
        let Some((function, module)) = parts.split_last() else {
            return Err("an empty name".into());
        };
        let module: Vec<&str> = module.iter().copied().filter(|p| *p != "tests").collect();
        let base = root().join("src").join(module.join("/"));
        let file = [base.with_extension("rs"), base.join("mod.rs")]
            .into_iter()
            .find(|f| f.exists())
            .ok_or_else(|| format!("no src/{}.rs nor src/{}/mod.rs", module.join("/"), module.join("/")))?;
        return if defines_test(&read(file.clone())?, function) {
            Ok(())
        } else {
            Err(format!("{} has no test fn {function}", file.display()))
        };
    }
    let Some((module, function)) = name.split_once("::") else {
        return Err("not module::function (a file:line drifts; name the test)".into());
    };
    let file = root().join("tests/it").join(format!("{module}.rs"));
    let source = read(file.clone())?;
    let found = if function == "*" {
        source.contains("#[test]") || source.contains("#[tokio::test")
    } else {
        defines_test(&source, function)
    };
    if found {
        Ok(())
    } else {
        Err(format!("{} has no test fn {function}", file.display()))
    }
}

#[test]
fn a_test_column_is_read_and_only_test_functions_resolve() {
    let source = "#[tokio::test(start_paused = true)]\n/// why\nasync fn paused() {}\n\n#[test]\nfn plain() {}\n\nfn helper() {}\n";
    assert!(defines_test(source, "paused") && defines_test(source, "plain"));
    assert!(!defines_test(source, "helper") && !defines_test(source, "missing"));
    assert!(resolve("limits.rs:655").is_err(), "a line number is not a name");
    let table = "## Other\n\n| a | test |\n|---|---|\n| x | `no::where` |\n\n## Limits\n\n| flag | test |\n|---|---|\n| `--f` | `a::b`, `c::d` |\n| `--g` | see above |\n| `--h` | |\n";
    assert_eq!(
        named_tests(table, "Limits"),
        [
            ("--f".to_owned(), vec!["a::b".to_owned(), "c::d".to_owned()]),
            ("--g".to_owned(), vec![]),
            ("--h".to_owned(), vec![]),
        ]
    );
}

/// Every row of reference.md's limits and bad-input tables names a test
/// that exists, so a renamed or deleted test cannot leave a row promising
/// what nothing checks.
#[test]
fn every_limit_and_bad_input_row_names_a_test_that_exists() {
    let reference = std::fs::read_to_string(root().join("docs/reference.md")).unwrap();
    let rows = named_tests(&reference, "Limits and bad input");
    // A parse that lost a table (its heading raised to `##`, or the table
    // moved out of the section) would pass while checking none of its
    // rows: both tables' first rows must have been read.
    for (table, first) in [
        ("Limits table", "--max-connections"),
        ("Bad input, and the answer", "a request that is not valid protobuf"),
    ] {
        assert!(
            rows.iter().any(|(row, _)| row.starts_with(first)),
            "the {table:?} under \"Limits and bad input\" was not read (no row {first:?}): \
             keep both tables, as `###` sections, under that `##` heading"
        );
    }
    let mut missing = Vec::new();
    for (row, names) in &rows {
        if names.is_empty() {
            missing.push(format!(
                "row {row:?} names no test: put `module::test` in its last cell"
            ));
        }
        for name in names {
            if let Err(e) = resolve(name) {
                missing.push(format!("row {row:?} names `{name}`: {e}"));
            }
        }
    }
    assert!(missing.is_empty(), "rows naming no test:\n{}", missing.join("\n"));
}

/// The code block after the marker `<!-- {marker} -->` of
/// `docs/operating.md`: the examples the tests below run as written.
fn block_after(marker: &str) -> String {
    let text = std::fs::read_to_string(root().join("docs/operating.md")).unwrap();
    let at = text
        .find(&format!("<!-- {marker}"))
        .unwrap_or_else(|| panic!("docs/operating.md has no <!-- {marker} --> block"));
    let fence = text[at..].find("```").expect("a code block after the marker") + at;
    let body = text[fence..].find('\n').unwrap() + fence + 1;
    let end = text[body..].find("```").expect("the block ends") + body;
    text[body..end].to_owned()
}

/// The access policy examples of docs/operating.md, as one policy (their
/// rules added up): each identity reads what its example says and no more;
/// the broad `sa/*` of one example gives no tenant more.
#[test]
fn the_policy_examples_hold_together() {
    use mcp_xds_gateway::transport::access::{AccessPolicy, Grant};
    use mcp_xds_gateway::transport::identity::PeerIdentity;

    let mut rules = String::from("rules:\n");
    for example in ["policy: sds", "policy: istiod", "policy: tenant"] {
        let block = block_after(example);
        rules.push_str(block.strip_prefix("rules:\n").expect("each example is a policy"));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    std::fs::write(&path, &rules).unwrap();
    let policy = AccessPolicy::load(&path).unwrap_or_else(|e| panic!("{e}\n{rules}"));
    const SECRETS: &str = "envoy/extensions/transport_sockets/tls/v3/secrets";
    const ROUTES: &str = "envoy/config/route/v3/routeconfigurations";
    const CLUSTERS: &str = "envoy/config/cluster/v3/clusters";
    const LISTENERS: &str = "envoy/config/listener/v3/listeners";
    const VS: &str = "istio/networking/v1alpha3/virtualservices";
    let reads = |identity: &PeerIdentity, collection: &str, name: &str| match policy.grant(
        identity,
        collection,
        collection == SECRETS,
    ) {
        None => false,
        Some(Grant::All) => true,
        Some(Grant::Names(names)) => names.allows(name),
    };
    let uri = |id: &str| PeerIdentity::certified(vec![id.to_owned()], Vec::new());

    let tenant = uri("spiffe://tools.example.com/tenant-a/config-reader");
    for (collection, name, expected) in [
        (ROUTES, "tenant-a/main", true),
        (CLUSTERS, "tenant-a/backend", true),
        (ROUTES, "tenant-b/main", false),
        (CLUSTERS, "shared", false),
        (LISTENERS, "tenant-a/http", false),
        (SECRETS, "tenant-a/cert", false),
        (VS, "tenant-a/vs", false),
    ] {
        assert_eq!(
            reads(&tenant, collection, name),
            expected,
            "the tenant, {collection} {name}:\n{rules}"
        );
    }
    // The same id as a DNS SAN is no SPIFFE id: nothing.
    let spelled = PeerIdentity::certified(
        Vec::new(),
        vec!["spiffe://tools.example.com/tenant-a/config-reader".into()],
    );
    assert!(
        !reads(&spelled, ROUTES, "tenant-a/main"),
        "a DNS SAN spelling the tenant's id"
    );

    let workload = uri("spiffe://cluster.local/ns/shop/sa/frontend");
    for (collection, name, expected) in [
        (SECRETS, "shop/frontend-cert", true),
        (SECRETS, "payments/cert", false),
        (LISTENERS, "http", true),
        (CLUSTERS, "tenant-a/backend", true),
        (VS, "reviews", false),
    ] {
        assert_eq!(
            reads(&workload, collection, name),
            expected,
            "a workload, {collection} {name}"
        );
    }

    // istiod: the Istio kinds, and (as the docs say) what every workload reads.
    let istiod = uri("spiffe://cluster.local/ns/istio-system/sa/istiod");
    for (collection, name, expected) in [
        (VS, "reviews", true),
        (CLUSTERS, "any", true),
        (SECRETS, "istio-system/ca", true),
        (SECRETS, "shop/frontend-cert", false),
    ] {
        assert_eq!(
            reads(&istiod, collection, name),
            expected,
            "istiod, {collection} {name}"
        );
    }
}

/// The `Secret` source file of docs/operating.md passes `check`.
#[tokio::test]
async fn the_secret_example_passes_check() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("frontend-cert.yaml"), block_after("source: secret")).unwrap();
    let (code, stdout, stderr) = crate::operating::subcommand("check", &[dir.path().to_str().unwrap()]).await;
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    assert!(stderr.contains("1 file, 1 resource: 0 errors"), "{stderr}");
}

/// The certificate recipe of docs/operating.md, run line by line with
/// openssl as written, makes what the gateway (mTLS, `--client-allow` the
/// tenant's id) and the `client` command accept.
#[tokio::test]
#[cfg_attr(not(peer_openssl), ignore = "needs openssl (OPENSSL_BIN; .ci/run installs it)")]
async fn the_certificate_recipe_makes_what_the_gateway_and_client_accept() {
    let dir = tempfile::tempdir().unwrap();
    for line in block_after("recipe: certificates").lines() {
        let command = line.strip_prefix("$ ").expect("each line a command");
        let output = crate::helpers::within(
            "a command of the recipe",
            tokio::process::Command::new("bash")
                .args(["-c", command])
                .current_dir(dir.path())
                .kill_on_drop(true)
                .output(),
        )
        .await
        .unwrap();
        assert!(
            output.status.success(),
            "{command}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let file = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let source = root().join("examples/config");
    let gw = crate::helpers::start_gateway(&[
        "--source-dir",
        source.to_str().unwrap(),
        "--tls-cert",
        &file("server.crt"),
        "--tls-key",
        &file("server.key"),
        "--client-ca",
        &file("ca.crt"),
        "--client-allow",
        "spiffe://tools.example.com/tenant-a/config-reader",
    ])
    .await;
    let target = format!("https://{}", gw.listen);
    let (code, stdout, stderr) = crate::operating::subcommand(
        "client",
        &[
            "--target",
            &target,
            "--server-name",
            "localhost",
            "--ca",
            &file("ca.crt"),
            "--cert",
            &file("client.crt"),
            "--key",
            &file("client.key"),
            "--type-url",
            "istio/networking/v1alpha3/virtualservices",
            "--once",
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{stdout}{stderr}");
}
