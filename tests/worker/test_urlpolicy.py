"""SSRF policy: syntax at registration, every resolved address at call time."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from outbound.urlpolicy import (
    UrlRejected,
    check_url,
    check_url_syntax,
    forbidden_reason,
    parse_ip_literal,
    resolve_and_check,
)
from service.kit.errors import UrlNotAllowed
from service.rewards.service import check_registration_url

PUBLIC_V4 = "93.184.215.14"
PUBLIC_V6 = "2606:2800:21f:cb07:6820:80da:af6b:8b2c"

# Every literal form of a forbidden address (loopback, private, link-local, metadata...), plus their IPv6 disguises.
FORBIDDEN_LITERALS = [
    "https://127.0.0.1/score",
    "https://127.1/score",
    "https://0x7f000001/score",
    "https://2130706433/score",
    "https://0177.0.0.1/score",
    "https://0x7f.1/score",
    "https://[::1]/score",
    "https://[::ffff:127.0.0.1]/score",
    "https://[::ffff:7f00:1]/score",
    "https://[2002:7f00:1::]/score",  # 6to4 of 127.0.0.1
    "https://[64:ff9b::a00:1]/score",  # NAT64 of 10.0.0.1
    "https://[::127.0.0.1]/score",  # IPv4-compatible
    "https://10.0.0.1/score",
    "https://10.255.255.254/score",
    "https://172.16.0.1/score",
    "https://172.31.255.1/score",
    "https://192.168.1.1/score",
    "https://169.254.169.254/latest/meta-data",
    "https://[::ffff:169.254.169.254]/",
    "https://100.64.0.1/score",
    "https://100.127.255.254/score",
    "https://0.0.0.0/score",
    "https://224.0.0.1/score",
    "https://[fe80::1]/score",
    "https://[fc00::1]/score",
    "https://localhost/score",
    "https://api.localhost/score",
]

# Forms that become a forbidden host only once IDNA/NFKC-normalised, as a resolver would receive them.
UNICODE_FORMS = [
    "https://\u2460\u2461\u2466.0.0.1/score",  # circled digits: 127.0.0.1
    "https://\uff11\uff12\uff17\u3002\uff10\u3002\uff10\u3002\uff11/",  # fullwidth digits, ideographic dots
    "https://\u2460\u2461\u2466.1/",  # 127.1
    "https://\uff12\uff11\uff13\uff10\uff17\uff10\uff16\uff14\uff13\uff13/",  # fullwidth 2130706433
    "https://\uff10\uff58\uff17\uff46\uff10\uff10\uff10\uff10\uff10\uff11/",  # fullwidth 0x7f000001
    "https://\u2460\u2465\u2468.\u2461\u2464\u2463.\u2460\u2465\u2468.\u2461\u2464\u2463/",  # 169.254.169.254
    "https://\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54/",  # fullwidth localhost
    "https://api.LOCALHOST/",
]


class TestCheckUrlSyntaxProduction:
    @pytest.mark.parametrize("url", FORBIDDEN_LITERALS)
    def test_forbidden_literal_is_refused(self, url: str) -> None:
        with pytest.raises(UrlRejected):
            check_url_syntax(url, allow_private=False)

    @pytest.mark.parametrize(
        ("url", "needle"),
        [
            ("http://rewards.example.com/", "scheme 'http'"),
            ("ftp://rewards.example.com/", "scheme 'ftp'"),
            ("https://user:pw@rewards.example.com/", "credentials"),
            ("https://user@rewards.example.com/", "credentials"),
            ("https://rewards.example.com:99999/", "port"),
            ("https:///nohost", "no host"),
            ("https://rewards.example.com\\@127.0.0.1/", "backslash"),
            ("https://rewards.example.com/\n", "control"),
            ("https://bad_host!.com/", "not a valid host name"),
            ("https://[fe80::1%25eth0]/", "zone id"),
        ],
    )
    def test_bad_syntax_names_the_problem(self, url: str, needle: str) -> None:
        with pytest.raises(UrlRejected, match=needle):
            check_url_syntax(url, allow_private=False)

    @pytest.mark.parametrize("url", UNICODE_FORMS)
    def test_unicode_form_of_a_forbidden_host_is_refused(self, url: str) -> None:
        with pytest.raises(UrlRejected, match="loopback|metadata"):
            check_url_syntax(url, allow_private=False)

    def test_unicode_digits_are_stored_as_the_address_they_mean(self) -> None:
        # Development allows loopback; what is stored is the address, not the disguise.
        assert check_url_syntax("http://\u2460\u2461\u2466.0.0.1:8000/r", allow_private=True) == (
            "http://127.0.0.1:8000/r"
        )
        with pytest.raises(UrlRejected, match="metadata"):
            check_url_syntax(UNICODE_FORMS[5], allow_private=True)

    def test_public_url_is_normalised(self) -> None:
        assert check_url_syntax("HTTPS://Rewards.Example.COM:443/Score?x=1", allow_private=False) == (
            "https://rewards.example.com/Score?x=1"
        )
        assert (
            check_url_syntax(f"https://{PUBLIC_V4}:8443", allow_private=False) == f"https://{PUBLIC_V4}:8443/"
        )
        assert check_url_syntax(f"https://[{PUBLIC_V6}]/", allow_private=False) == f"https://[{PUBLIC_V6}]/"

    def test_error_names_the_problem_and_registration_makes_it_a_422(self) -> None:
        with pytest.raises(UrlRejected) as info:
            check_url_syntax("https://10.1.2.3/", allow_private=False)
        assert info.value.code == "url_rejected"
        assert "private" in info.value.message
        with pytest.raises(UrlNotAllowed) as domain:
            check_registration_url("https://10.1.2.3/", allow_private=False)
        assert domain.value.http_status == 422
        assert domain.value.code == "url_rejected"
        assert domain.value.message == info.value.message


class TestCheckUrlSyntaxDevelopment:
    def test_loopback_and_http_allowed_and_canonicalised(self) -> None:
        assert check_url_syntax("http://127.1:8000/r", allow_private=True) == "http://127.0.0.1:8000/r"
        assert check_url_syntax("http://0x7f000001:8000/r", allow_private=True) == "http://127.0.0.1:8000/r"
        assert check_url_syntax("http://[::1]:8000/r", allow_private=True) == "http://[::1]:8000/r"
        assert check_url_syntax("http://localhost:8000", allow_private=True) == "http://localhost:8000/"

    @pytest.mark.parametrize(
        "url",
        [
            "http://169.254.169.254/",
            "http://[::ffff:169.254.169.254]/",
            "http://0.0.0.0/",
            "http://239.1.1.1/",
        ],
    )
    def test_metadata_multicast_unspecified_refused_even_in_development(self, url: str) -> None:
        with pytest.raises(UrlRejected):
            check_url_syntax(url, allow_private=True)

    def test_https_can_still_be_required(self) -> None:
        with pytest.raises(UrlRejected, match="scheme"):
            check_url_syntax("http://127.0.0.1/", allow_private=True, require_https=True)


# Link-local and cloud-internal addresses (issue 30): refused in production, as literals and as a name's answers,
# without any connection being made (the scripted resolver answers; nothing is dialled).
CLOUD_INTERNAL = [
    ("169.254.0.1", "a link-local address"),
    ("169.254.255.254", "a link-local address"),
    ("169.254.169.254", "a cloud metadata address"),  # AWS, GCP, Azure IMDS
    ("168.63.129.16", "a cloud metadata address"),  # Azure WireServer: a public address
    ("100.100.100.200", "a cloud metadata address"),  # Alibaba
    ("fd00:ec2::254", "a cloud metadata address"),  # AWS IMDS over IPv6
    ("fe80::1", "a link-local address"),
    ("febf:ffff::1", "a link-local address"),  # the top of fe80::/10
]


class TestCloudInternalAddresses:
    @pytest.mark.parametrize(("address", "reason"), CLOUD_INTERNAL)
    def test_literal_is_refused_in_production(self, address: str, reason: str) -> None:
        host = f"[{address}]" if ":" in address else address
        with pytest.raises(UrlRejected, match=f"is {reason}$"):
            check_url_syntax(f"https://{host}/score", allow_private=False)

    @pytest.mark.parametrize(("address", "reason"), CLOUD_INTERNAL)
    async def test_answer_is_refused_in_production_without_naming_it(self, address: str, reason: str) -> None:
        resolver = scripted_resolver([PUBLIC_V4, address])
        with pytest.raises(UrlRejected) as refused:
            await check_url("https://rewards.example.com/score", allow_private=False, resolver=resolver)
        assert refused.value.message == f"url host rewards.example.com resolves to {reason}"
        assert address not in str(refused.value.details)

    @pytest.mark.parametrize("address", ["168.63.129.16", "100.100.100.200", "fd00:ec2::254", "169.254.169.254"])
    def test_metadata_addresses_are_refused_in_development_too(self, address: str) -> None:
        host = f"[{address}]" if ":" in address else address
        with pytest.raises(UrlRejected, match="cloud metadata"):
            check_url_syntax(f"http://{host}/score", allow_private=True)


class TestParseIpLiteral:
    @pytest.mark.parametrize(
        "host", ["127.0.0.1", "127.1", "0x7f000001", "2130706433", "0177.0.0.1", "0x7f.0.0.1"]
    )
    def test_inet_aton_forms(self, host: str) -> None:
        assert str(parse_ip_literal(host)) == "127.0.0.1"

    @pytest.mark.parametrize(
        "host", ["example.com", "deadbeef", "1e100.net", "cafe.be", "127.0.0.1.example.com"]
    )
    def test_names_are_not_addresses(self, host: str) -> None:
        assert parse_ip_literal(host) is None


class TestForbiddenReason:
    @pytest.mark.parametrize("ip", [PUBLIC_V4, PUBLIC_V6, "8.8.8.8", "1.1.1.1"])
    def test_public_addresses_pass(self, ip: str) -> None:
        addr = parse_ip_literal(ip)
        assert addr is not None
        assert forbidden_reason(addr, allow_private=False) is None

    def test_cgnat_is_named(self) -> None:
        addr = parse_ip_literal("100.64.1.1")
        assert addr is not None
        assert forbidden_reason(addr, allow_private=False) == "a carrier-grade NAT (100.64.0.0/10) address"


def scripted_resolver(*answers: Sequence[str]):  # type: ignore[no-untyped-def]
    """A resolver that gives the scripted answers in turn (the last one repeats) and records its calls."""
    calls: list[str] = []

    async def resolve(host: str, port: int) -> Sequence[str]:
        calls.append(host)
        return answers[min(len(calls) - 1, len(answers) - 1)]

    resolve.calls = calls  # type: ignore[attr-defined]
    return resolve


class TestResolveAndCheck:
    async def test_hostname_resolving_to_loopback_is_refused(self) -> None:
        resolver = scripted_resolver(["127.0.0.1"])
        with pytest.raises(UrlRejected) as refused:
            await check_url("https://rewards.example.com/", allow_private=False, resolver=resolver)
        # The host as given and the class of address; never the address it resolved to (issue 30).
        assert refused.value.message == "url host rewards.example.com resolves to a loopback address"
        assert refused.value.details == {"host": "rewards.example.com"}

    async def test_one_private_record_among_public_ones_is_refused(self) -> None:
        resolver = scripted_resolver([PUBLIC_V4, "10.0.0.7"])
        with pytest.raises(UrlRejected, match="^url host rewards.example.com resolves to a private address$"):
            await resolve_and_check("rewards.example.com", 443, allow_private=False, resolver=resolver)

    async def test_mapped_aaaa_record_is_refused(self) -> None:
        resolver = scripted_resolver([PUBLIC_V4, "::ffff:192.168.0.1"])
        with pytest.raises(UrlRejected, match="^url host rewards.example.com resolves to an IPv6 form of a private"):
            await resolve_and_check("rewards.example.com", 443, allow_private=False, resolver=resolver)

    async def test_public_then_private_answer_is_refused_at_call_time(self) -> None:
        # DNS rebinding: registration sees a public address, the next lookup (the call) a private one.
        resolver = scripted_resolver([PUBLIC_V4], ["192.168.1.10"])
        url = await check_url("https://rewards.example.com/", allow_private=False, resolver=resolver)
        assert url == "https://rewards.example.com/"
        with pytest.raises(UrlRejected, match="rewards.example.com resolves to a private address$"):
            await resolve_and_check("rewards.example.com", 443, allow_private=False, resolver=resolver)

    async def test_public_answers_are_returned(self) -> None:
        resolver = scripted_resolver([PUBLIC_V4, PUBLIC_V6])
        addrs = await resolve_and_check("rewards.example.com", 443, allow_private=False, resolver=resolver)
        assert [str(a) for a in addrs] == [PUBLIC_V4, PUBLIC_V6]

    async def test_private_allowed_in_development(self) -> None:
        resolver = scripted_resolver(["127.0.0.1"])
        addrs = await resolve_and_check("reward.test", 80, allow_private=True, resolver=resolver)
        assert [str(a) for a in addrs] == ["127.0.0.1"]

    async def test_literal_is_not_resolved(self) -> None:
        resolver = scripted_resolver([PUBLIC_V4])
        with pytest.raises(UrlRejected):
            await resolve_and_check("0x7f000001", 443, allow_private=False, resolver=resolver)
        assert resolver.calls == []  # type: ignore[attr-defined]

    async def test_unresolvable_name_is_refused(self) -> None:
        with pytest.raises(UrlRejected, match="does not resolve"):
            await check_url("https://no-such-host.invalid/", allow_private=False)

    async def test_system_resolver_sees_loopback(self) -> None:
        # The real getaddrinfo path: "localhost" resolves to 127.0.0.1 / ::1, both refused.
        with pytest.raises(UrlRejected, match="^url host localhost resolves to a loopback address$"):
            await resolve_and_check("localhost", 443, allow_private=False)
