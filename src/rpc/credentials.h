// gRPC credentials from TlsFiles, shared by the engine's server and client and the remote reward
// client. Private to src (gRPC headers stay out of the public ones).
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include <fmt/format.h>

#include "tiller/core/error.h"
#include "tiller/core/files.h"
#include "tiller/core/tls.h"

namespace tiller::rpc {

inline std::string read_pem(const std::string& path, const char* what) {
  std::optional<std::string> text = read_file(path);
  if (!text || text->empty()) throw ConfigError(fmt::format("{} {}: cannot read it (a PEM file)", what, path));
  if (text->find("-----BEGIN ") == std::string::npos)
    throw ConfigError(fmt::format("{} {}: not a PEM file (no -----BEGIN line)", what, path));
  return *text;
}

// TLS with tls.cert and tls.key, or plaintext when neither is given.
inline std::shared_ptr<grpc::ServerCredentials> server_credentials(const TlsFiles& tls) {
  if (tls.cert.empty() && tls.key.empty()) return grpc::InsecureServerCredentials();
  if (tls.cert.empty() || tls.key.empty())
    throw ConfigError("TLS needs both a certificate and its private key; give both paths or neither");
  grpc::SslServerCredentialsOptions o;
  o.pem_key_cert_pairs.push_back({read_pem(tls.key, "TLS key"), read_pem(tls.cert, "TLS certificate")});
  return grpc::SslServerCredentials(o);
}

// TLS verified against tls.ca (and tls.server_name, set on `args`), or plaintext without a CA.
inline std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const TlsFiles& tls, grpc::ChannelArguments& args) {
  if (!tls.dials_tls()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = read_pem(tls.ca, "TLS CA");
  if (!tls.server_name.empty()) args.SetSslTargetNameOverride(tls.server_name);
  return grpc::SslCredentials(o);
}

}  // namespace tiller::rpc
