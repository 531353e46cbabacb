// The trainer roles of a job, in the one canonical order that the rank plan (its groups and rank
// layout), the controller (its messages and metrics) and the trainer ranks (their models and
// replies) all use: actor, critic, ref, reward.
#pragma once

#include <array>
#include <optional>
#include <string_view>

namespace tiller {

enum class Role { kActor = 0, kCritic = 1, kRef = 2, kReward = 3 };

inline constexpr int kRoleCount = 4;
inline constexpr std::array<Role, kRoleCount> kRoles = {Role::kActor, Role::kCritic, Role::kRef, Role::kReward};

constexpr int role_index(Role r) { return static_cast<int>(r); }

// "actor", "critic", "ref", "reward".
constexpr std::string_view role_name(Role r) {
  switch (r) {
    case Role::kActor: return "actor";
    case Role::kCritic: return "critic";
    case Role::kRef: return "ref";
    case Role::kReward: return "reward";
  }
  return "?";
}

// The role of that name, or nullopt.
constexpr std::optional<Role> parse_role(std::string_view name) {
  for (Role r : kRoles)
    if (role_name(r) == name) return r;
  return std::nullopt;
}

// The roles that train (an optimizer and a weight update each step).
constexpr bool role_trains(Role r) { return r == Role::kActor || r == Role::kCritic; }

// A set of roles (the roles one rank holds), iterated in the canonical order.
class RoleSet {
 public:
  constexpr RoleSet() = default;
  constexpr void add(Role r) { bits_ |= 1u << role_index(r); }
  constexpr bool has(Role r) const { return (bits_ >> role_index(r)) & 1u; }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr unsigned bits() const { return bits_; }
  static constexpr RoleSet from_bits(unsigned b) {
    RoleSet s;
    s.bits_ = b & ((1u << kRoleCount) - 1);
    return s;
  }
  constexpr bool operator==(const RoleSet& o) const { return bits_ == o.bits_; }

 private:
  unsigned bits_ = 0;
};

}  // namespace tiller
