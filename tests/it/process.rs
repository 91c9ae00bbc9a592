//! The real binary: flags validated at start-up, port 0, the bound addresses
//! in one log line, and SIGTERM.

use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::helpers::clients::sotw;
use crate::helpers::galley::{resource, FakeGalley};
use crate::helpers::{names, within, VS};

const BIN: &str = env!("CARGO_BIN_EXE_mcp-xds-gateway");

/// Runs the binary to its exit: (exit code, stderr).
async fn run(args: &[&str]) -> (Option<i32>, String) {
    run_with_env(args, &[]).await
}

async fn run_with_env(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let output = within(
        "the gateway to exit",
        Command::new(BIN)
            .args(args)
            .envs(env.iter().copied())
            .env_remove("RUST_LOG")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("run the gateway binary");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn bad_flags_exit_non_zero_naming_the_flag() {
    for (args, flag) in [
        (&["--collections", "istio/nope"][..], "--collections"),
        (&["--upstream", "galley:9901"][..], "--upstream"),
        (&["--listen", "not-an-address"][..], "--listen"),
        (&["--keepalive-interval", "often"][..], "--keepalive-interval"),
        (&["--type-map", "/nonexistent/types.yaml"][..], "--type-map"),
        (&["--no-such-flag"][..], "--no-such-flag"),
    ] {
        let (code, stderr) = run(args).await;
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?} should name {flag}: {stderr}");
    }
}

#[tokio::test]
async fn a_taken_port_is_a_start_up_error_naming_the_flag() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (code, stderr) = run(&["--listen", &addr, "--admin-listen", "127.0.0.1:0"]).await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("--listen") && stderr.contains(&addr), "{stderr}");
}

#[tokio::test]
async fn serves_on_port_zero_and_exits_cleanly_on_sigterm() {
    let mut galley = FakeGalley::start().await;
    let mut child = Command::new(BIN)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--collections",
            VS,
        ])
        .args(["--upstream", &galley.url()])
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start the gateway binary");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut effective_config_lines = 0;
    let (listen, admin) = within("the bound addresses in the log", async {
        loop {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .expect("the gateway logs before exiting");
            if line.contains("effective configuration") {
                effective_config_lines += 1;
                assert!(line.contains(&galley.url()) && line.contains(VS), "{line}");
            }
            if line.contains("gateway listening") {
                let field = |name: &str| -> std::net::SocketAddr {
                    let start = line.find(&format!("{name}=")).unwrap() + name.len() + 1;
                    line[start..].split_whitespace().next().unwrap().parse().unwrap()
                };
                return (field("listen"), field("admin"));
            }
        }
    })
    .await;
    assert_ne!(listen.port(), 0);
    assert_ne!(admin.port(), 0);
    assert_eq!(
        effective_config_lines, 1,
        "the effective configuration is logged once, before listening"
    );
    // Keep draining the log so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    let mut upstream = galley.next_stream().await;
    upstream.initial_requests(1).await;
    upstream.push_full(VS, vec![resource("a", "1", b"a")]).await;
    let mut client = sotw(listen).await;
    client.subscribe(VS);
    assert_eq!(names(&client.recv().await.resources), ["a"]);

    let pid = child.id().unwrap().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().await.unwrap();
    assert!(killed.success());
    let status = within("the gateway to exit after SIGTERM", child.wait()).await.unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(client.end_status().await.code(), tonic::Code::Unavailable);
}

#[tokio::test]
async fn environment_fallbacks_are_read_and_validated_like_flags() {
    let env = [
        (
            "MCP_GATEWAY_COLLECTIONS",
            "istio/networking/v1alpha3/gateways,istio/nope",
        ),
        ("MCP_GATEWAY_LISTEN", "127.0.0.1:0"),
        ("MCP_GATEWAY_ADMIN_LISTEN", "127.0.0.1:0"),
    ];
    let (code, stderr) = run_with_env(&[], &env).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--collections") && stderr.contains("istio/nope"),
        "{stderr}"
    );

    let (code, stderr) = run_with_env(&[], &[("MCP_GATEWAY_KEEPALIVE_INTERVAL", "sometimes")]).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--keepalive-interval"), "{stderr}");
}
