// TLS for tiller's gRPC services (the engines, the remote reward) when they cross hosts: paths to
// PEM files. A server needs its certificate and key; a client turns TLS on by naming the CA that
// signed the server's certificate (for a self-signed certificate, that certificate itself).
#pragma once

#include <string>

namespace tiller {

struct TlsFiles {
  std::string cert, key;    // server: its certificate chain and private key (both or neither)
  std::string ca;           // client: verify the server against these roots ("": no TLS)
  std::string server_name;  // client: the name the server's certificate must carry ("": the address's host)

  bool serves_tls() const { return !cert.empty(); }
  bool dials_tls() const { return !ca.empty(); }
};

// Whether `host` (an address's host part, brackets allowed) can only be reached from this machine:
// localhost, 127.0.0.0/8, ::1.
bool is_loopback_host(const std::string& host);

// The first line of `path`, a shared secret; ConfigError naming `what` and the file when it cannot be
// read or the line is empty.
std::string read_secret_file(const std::string& path, const std::string& what);

// Equality of two secrets in time that depends only on their lengths (no early exit on the first
// differing byte, which a caller could time).
bool secrets_equal(const std::string& a, const std::string& b);

}  // namespace tiller
