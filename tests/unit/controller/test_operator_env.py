"""`kiln operator` settings from KILN_OPERATOR_* environment variables: a flag wins over its
variable, a variable over the built-in default, and a bad value is an error naming the variable."""

from __future__ import annotations

import pytest

from kiln.controller import main, settings


def _options(argv: list[str], environ: dict[str, str]) -> settings.Options:
    return main.options_from_args(main.build_parser(environ=environ).parse_args(argv))


def test_flag_beats_env_beats_default() -> None:
    environ = {"KILN_OPERATOR_ZOO_RETRY_LIMIT": "7", "KILN_OPERATOR_ZOO_URI": "s3://from-env",
               "KILN_OPERATOR_PLACEMENT_USE_MILP": "false",
               "KILN_OPERATOR_NAMESPACES": "team-a, team-b",
               "KILN_OPERATOR_PRIORITY_WEIGHTS": "high=4"}
    from_env = _options([], environ)
    assert from_env.zoo_retry_limit == 7 and from_env.zoo_uri == "s3://from-env"
    assert from_env.placement_use_milp is False
    assert from_env.namespaces == ("team-a", "team-b")
    assert settings.priority_weights(from_env) == {"high": 4.0}
    assert from_env.metrics_port == settings.Options().metrics_port  # no variable: default
    flags = _options(["--zoo-retry-limit", "2", "--placement-use-milp", "-n", "team-c",
                      "--priority-weight", "low=0.5"], environ)
    assert flags.zoo_retry_limit == 2 and flags.placement_use_milp is True
    assert flags.namespaces == ("team-c",)  # the flags replace the variable's list
    assert settings.priority_weights(flags) == {"low": 0.5}
    assert flags.zoo_uri == "s3://from-env"


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("KILN_OPERATOR_ZOO_RETRY_LIMIT", "many", "expected a whole number, got 'many'"),
    ("KILN_OPERATOR_METRICS_PORT", "70000", "a port is at most 65535"),
    ("KILN_OPERATOR_PLACEMENT_USE_MILP", "maybe", "expected one of 1, true, yes, on, 0"),
    ("KILN_OPERATOR_IMAGE_PULL_POLICY", "Sometimes", "invalid choice 'Sometimes'"),
    ("KILN_OPERATOR_NAMESPACE_GPU_QUOTA", "team-a", "expected name=value"),
])
def test_a_bad_variable_fails_the_operator_naming_the_variable_and_its_flag(
    variable: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(variable, value)
    assert main.main(["--kubeconfig", "/nonexistent"]) == 2  # before anything is contacted
    out = capsys.readouterr().out
    assert f"kiln operator: error: environment variable {variable}={value!r}: " in out, out
    assert message in out and "fix or unset it (or pass --" in out


def test_kubernetes_service_links_named_like_a_setting_are_not_settings() -> None:
    # A Service kiln-operator-metrics in the namespace gives every pod this variable.
    options = _options([], {"KILN_OPERATOR_METRICS_PORT": "tcp://10.0.0.7:9100"})
    assert options.metrics_port == settings.Options().metrics_port


def test_gpu_resources_from_the_variable_are_a_comma_separated_list_a_flag_replaces() -> None:
    one = _options([], {"KILN_OPERATOR_GPU_RESOURCES": "amd.com/gpu"})
    assert one.gpu_resources == ("amd.com/gpu",)
    two = _options([], {"KILN_OPERATOR_GPU_RESOURCES": "amd.com/gpu, nvidia.com/mig-1g.10gb"})
    assert two.gpu_resources == ("amd.com/gpu", "nvidia.com/mig-1g.10gb")
    flag = _options(["--gpu-resource", "nvidia.com/gpu"],
                    {"KILN_OPERATOR_GPU_RESOURCES": "amd.com/gpu"})
    assert flag.gpu_resources == ("nvidia.com/gpu",)


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("KILN_OPERATOR_NAMESPACES", "", "an empty list; give comma-separated entries"),
    ("KILN_OPERATOR_NAMESPACES", ",,,", "an empty list; give comma-separated entries"),
    ("KILN_OPERATOR_NAMESPACES", "Bad_NS", "'Bad_NS' is not a namespace name"),
    ("KILN_OPERATOR_GPU_RESOURCES", "gpu", "'gpu' is not an extended resource name"),
    ("KILN_OPERATOR_ZOO_URI", "", "zoo URI is empty"),
    ("KILN_OPERATOR_ZOO_URI", "ftp://x", "zoo URI 'ftp://x': unsupported scheme 'ftp'"),
])
def test_settings_are_checked_before_connecting(
    variable: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(variable, value)
    assert main.main(["--kubeconfig", "/nonexistent"]) == 2
    out = capsys.readouterr().out
    assert f"environment variable {variable}={value!r}: {message}" in out, out


@pytest.mark.parametrize(("argv", "message"), [
    (["-n", "Bad_NS"], "'Bad_NS' is not a namespace name"),
    (["--zoo-uri", "ftp://x"], "unsupported scheme 'ftp'"),
    (["--zoo-uri", ""], "zoo URI is empty"),
    (["--zoo-uri", "s3://"], "name the bucket"),
])
def test_a_bad_namespace_or_zoo_uri_flag_fails_before_connecting(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main.main(argv)
    assert message in capsys.readouterr().err


def test_an_unreadable_kubeconfig_from_the_variable_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KILN_OPERATOR_KUBECONFIG", "/nonexistent")
    assert main.main([]) == 2
    assert "error: KILN_OPERATOR_KUBECONFIG /nonexistent: cannot read it" in capsys.readouterr().out
    assert main.main(["--kubeconfig", "/missing"]) == 2
    assert "error: --kubeconfig /missing: cannot read it" in capsys.readouterr().out


def test_an_unknown_variable_is_warned_about_with_the_nearest_setting() -> None:
    environ = {"KILN_OPERATOR_NAMESPACE": "team-a", "KILN_OPERATOR_ZOO_URI": "/zoo",
               "KILN_OPERATOR_METRICS_SERVICE_HOST": "10.0.0.7",
               "KILN_OPERATOR_METRICS_PORT_9100_TCP_ADDR": "10.0.0.7"}
    warnings = main.unknown_variables(main.build_parser(environ=environ), environ)
    (warning,) = warnings
    assert warning == ("environment variable KILN_OPERATOR_NAMESPACE is not a setting and is "
                       "ignored; did you mean KILN_OPERATOR_NAMESPACES?")


def test_a_zero_zoo_capacity_is_refused(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KILN_OPERATOR_ZOO_CAPACITY", "0")
    assert main.main(["--kubeconfig", "/nonexistent"]) == 2
    assert "KILN_OPERATOR_ZOO_CAPACITY='0': " in capsys.readouterr().out
